// Validate an AsyncAPI document with the official parser (@asyncapi/parser): prints one JSON line per
// diagnostic and a last line {"valid": bool}; exits 1 when the document has errors.
//
//   node validate_asyncapi.cjs asyncapi.json
'use strict';

const fs = require('fs');
const { Parser } = require('@asyncapi/parser');

(async () => {
  const { document, diagnostics } = await new Parser().parse(fs.readFileSync(process.argv[2], 'utf8'));
  for (const d of diagnostics) {
    process.stdout.write(JSON.stringify({ severity: d.severity, code: d.code, message: d.message,
                                          path: d.path.join('/') }) + '\n');
  }
  const valid = document !== undefined && !diagnostics.some((d) => d.severity === 0);
  process.stdout.write(JSON.stringify({ valid, version: document && document.version() }) + '\n');
  process.exit(valid ? 0 : 1);
})().catch((e) => {
  process.stderr.write(`${e.stack || e}\n`);
  process.exit(1);
});
