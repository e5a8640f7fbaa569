// A kvbus client written from the exported contract alone (`kvbus schemas export DIR`: asyncapi.json),
// not from kvbus's Python code: subjects, header names and values, the messages a reply may hold and
// their JSON Schemas all come from the AsyncAPI document; every message received is checked against it.
//
//   node client.cjs CONTRACT_DIR NATS_URL PLAN_JSON     call kvbus, one JSON line per message and a summary
//   node client.cjs CONTRACT_DIR - '{"validate": OP}'   check messages another client received (stdin:
//                                                       one {"headers": {...}, "body": ...} per line)
//
// PLAN_JSON: {"op": operation id (e.g. "generate", "generateOnce"), "body": the request,
//   "probes": ask for interest probes, "answer": "alive" to answer them (else skipped),
//   "cancel_after": publish a CancelEvent after that many chunks and stop, "timeout_s": Kvbus-Timeout,
//   "copies": send that many at once (single replies), "stall_s": give up after that long with nothing}
'use strict';

const fs = require('fs');
const path = require('path');
const crypto = require('crypto');
const Ajv = require('ajv');

const [contractDir, natsUrl, planText] = process.argv.slice(2);
const doc = JSON.parse(fs.readFileSync(path.join(contractDir, 'asyncapi.json'), 'utf8'));
const plan = JSON.parse(planText || '{}');
const ajv = new Ajv({ strict: false, allErrors: true });
ajv.addSchema({ $id: 'kvbus:contract', components: doc.components }); // payload $refs: #/components/schemas/...

function resolve(ref) { // '#/a/b/c' in the document
  return ref.slice(2).split('/').reduce((node, key) => node[key], doc);
}
function deref(node) {
  while (node && node.$ref) node = resolve(node.$ref);
  return node;
}
function out(line) {
  process.stdout.write(JSON.stringify(line) + '\n');
}

// --- what the contract says about one operation ------------------------------------------------------
function describe(opId) {
  const op = doc.operations[opId];
  if (!op) throw new Error(`no operation ${opId} in the contract`);
  const channel = deref(op.channel);
  const request = deref(op.messages[0]);
  const replies = (op.reply ? op.reply.messages : []).map(deref);
  const probeOp = doc.operations[`${opId}Probe`];
  if (probeOp) replies.push(...probeOp.messages.map(deref));
  const byFrame = {}; // Kvbus-Stream value -> the message it marks
  let error = null; let single = null;
  for (const message of replies) {
    const required = message.headers.required || [];
    const frame = message.headers.properties['Kvbus-Stream'];
    if (required.includes('Kvbus-Error-Code')) error = message;
    else if (frame && frame.const) byFrame[frame.const] = message;
    else single = message;
  }
  const answers = probeOp ? probeOp.reply.messages.map(deref) : [];
  return { op, address: channel.address, request, byFrame, error, single, answers,
           streamed: channel['x-kvbus'].streamed };
}

const validators = new Map();
function validator(schema) {
  if (!validators.has(schema)) {
    const ref = schema.$ref ? { $ref: `kvbus:contract${schema.$ref}` } : schema;
    validators.set(schema, ajv.compile(ref));
  }
  return validators.get(schema);
}
function check(schema, value) {
  const validate = validator(schema);
  return validate(value) ? null : validate.errors.map((e) => `${e.instancePath} ${e.message}`);
}

// One received message: which message of the contract it is, and whether headers and body conform.
function classify(spec, headers, body) {
  let kind; let message;
  if (headers['Kvbus-Error-Code'] !== undefined) { kind = 'error'; message = spec.error; }
  else if (headers['Kvbus-Stream'] !== undefined) {
    kind = headers['Kvbus-Stream']; message = spec.byFrame[kind];
  } else { kind = 'reply'; message = spec.single; }
  if (!message) return { kind, problems: [`no message of the contract is a ${kind} here`] };
  const problems = [];
  const headerErrors = check(message.headers, headers);
  if (headerErrors) problems.push(...headerErrors.map((e) => `headers${e}`));
  let parsed = null;
  if (message.payload) {
    try {
      parsed = JSON.parse(body);
      const payloadErrors = check(message.payload, parsed);
      if (payloadErrors) problems.push(...payloadErrors.map((e) => `body${e}`));
    } catch (e) {
      problems.push(`body is not JSON: ${e.message}`);
    }
  } else if (body.length !== 0) {
    problems.push(`a ${kind} message has no body in the contract, got ${body.length} bytes`);
  }
  return { kind, problems, body: parsed, message: message.name };
}

// --- validating what another client received ---------------------------------------------------------
async function validateStdin(opId) {
  const spec = describe(opId);
  const lines = fs.readFileSync(0, 'utf8').split('\n').filter((l) => l.trim());
  let numBad = 0;
  for (const line of lines) {
    const { headers, body } = JSON.parse(line);
    const text = body === null || body === undefined ? '' : JSON.stringify(body);
    const verdict = classify(spec, headers, text);
    if (verdict.problems.length) numBad += 1;
    out({ event: 'checked', kind: verdict.kind, problems: verdict.problems });
  }
  out({ event: 'done', checked: lines.length, bad: numBad });
}

// --- calling kvbus --------------------------------------------------------------------------------------
async function call() {
  const { connect, headers: natsHeaders, createInbox, Empty } = require('nats');
  const spec = describe(plan.op);
  const nc = await connect({ servers: natsUrl });
  const encoder = new TextEncoder(); const decoder = new TextDecoder();
  const requestHeaders = spec.request.headers.properties;
  if (plan.probes && !requestHeaders['Kvbus-Probe']) throw new Error(`${plan.op} takes no probe opt-in`);
  const bodyErrors = check(spec.request.payload, plan.body);
  out({ event: 'request', valid: bodyErrors === null, problems: bodyErrors });

  async function one(copy) {
    const requestId = crypto.randomUUID().replace(/-/g, '');
    const h = natsHeaders();
    h.set('Content-Type', 'application/json');
    h.set('Kvbus-Request-Id', requestId);
    if (plan.timeout_s) h.set('Kvbus-Timeout', String(plan.timeout_s));
    if (plan.probes) h.set('Kvbus-Probe', 'accept');
    const inbox = createInbox();
    const sub = nc.subscribe(inbox);
    nc.publish(spec.address, encoder.encode(JSON.stringify(plan.body)), { reply: inbox, headers: h });
    const summary = { event: 'done', copy, request_id: requestId, chunks: 0, probes: 0, answered: 0, text: '',
                      problems: [], ended: null, error: null, retry_after: null, seqs: [] };
    const started = Date.now(); let firstAt = null; let lastAt = null;
    let stall = null;
    const armStall = () => {
      clearTimeout(stall);
      stall = setTimeout(() => { summary.ended = 'stalled'; sub.unsubscribe(); }, (plan.stall_s || 120) * 1000);
    };
    armStall();
    for await (const msg of sub) {
      armStall();
      if (msg.headers && msg.headers.hasError && msg.headers.code === 503) { // nats-server: nobody subscribes
        summary.ended = 'no_responders'; break;
      }
      const headers = {};
      if (msg.headers) for (const k of msg.headers.keys()) headers[k] = msg.headers.get(k);
      const verdict = classify(spec, headers, decoder.decode(msg.data));
      summary.problems.push(...verdict.problems.map((p) => `${verdict.kind}: ${p}`));
      out({ event: 'message', copy, kind: verdict.kind, seq: headers['Kvbus-Seq'], problems: verdict.problems,
            body: verdict.body, headers });
      if (verdict.kind === 'probe') {
        summary.probes += 1;
        if (plan.answer && msg.reply) {
          const answer = natsHeaders();
          answer.set('Kvbus-Stream', plan.answer);
          const answerSpec = spec.answers.find((m) => m.headers.properties['Kvbus-Stream'].const === plan.answer);
          const answerErrors = answerSpec ? check(answerSpec.headers, { 'Kvbus-Stream': plan.answer }) : ['unknown'];
          if (answerErrors) summary.problems.push(`our probe answer: ${answerErrors}`);
          msg.respond(Empty, { headers: answer });
          summary.answered += 1;
        }
        continue;
      }
      if (verdict.kind === 'error') {
        summary.error = headers['Kvbus-Error-Code'];
        summary.retry_after = headers['Kvbus-Retry-After'] || null;
        summary.ended = 'error'; break;
      }
      if (verdict.kind === 'reply') {
        summary.text = verdict.body && verdict.body.text; summary.ended = 'reply'; break;
      }
      summary.seqs.push(Number(headers['Kvbus-Seq']));
      if (verdict.kind === 'end') { summary.ended = 'end'; break; }
      summary.chunks += 1;
      lastAt = Date.now(); if (firstAt === null) firstAt = lastAt;
      if (verdict.body && typeof verdict.body.text === 'string') summary.text += verdict.body.text;
      if (plan.cancel_after && summary.chunks >= plan.cancel_after) {
        const cancel = describe('cancel');
        const event = [requestId];
        const cancelErrors = check(cancel.request.payload, event);
        if (cancelErrors) summary.problems.push(`our CancelEvent: ${cancelErrors}`);
        const ch = natsHeaders(); ch.set('Content-Type', 'application/json');
        nc.publish(cancel.address, encoder.encode(JSON.stringify(event)), { headers: ch });
        await nc.flush();
        summary.ended = 'cancelled'; break;
      }
    }
    clearTimeout(stall);
    sub.unsubscribe();
    summary.elapsed_s = (Date.now() - started) / 1000;
    summary.streamed_s = firstAt === null ? 0 : (lastAt - firstAt) / 1000;
    return summary;
  }

  const copies = await Promise.all(Array.from({ length: plan.copies || 1 }, (_, i) => one(i)));
  copies.forEach(out);
  await nc.drain();
}

(natsUrl === '-' ? validateStdin(plan.validate) : call()).catch((e) => {
  process.stderr.write(`client failed: ${e.stack || e}\n`);
  process.exit(1);
});
