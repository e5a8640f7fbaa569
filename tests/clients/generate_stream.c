/* Call kvbus from C (Debian's libnats-dev), written from the exported contract (asyncapi.json).
 *
 *   generate_stream NATS_URL PROMPT MAX_TOKENS
 *       stream a greedy generation from kvbus.v1.generate; print each chunk's JSON on its own line
 *   generate_stream [-s SUBJECT] [-t SECONDS] [-c N] [-n COPIES] [-p] -m NATS_URL BODY_JSON
 *       send BODY_JSON on SUBJECT (default kvbus.v1.generate); print every message received as one
 *       line {"copy": i, "headers": {...}, "body": JSON or null}, for checking against the contract
 *       -t  Kvbus-Timeout: the seconds we wait
 *       -c  after N chunks publish a CancelEvent (["request id"] on kvbus.v1.cancel) and stop
 *       -n  send COPIES requests at once (single replies), each on its own reply subject
 *       -p  ask for interest probes (Kvbus-Probe: accept) and answer each "alive"
 *
 * Without -p no probe is ever sent to us. A stream ends with the message whose header Kvbus-Stream is
 * "end", or with an error (header Kvbus-Error-Code, empty body). Exits 1 on an error (plain mode), a
 * stall of 120 s or a NATS failure.
 */
#include <nats/nats.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_COPIES 64

static void print_json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

/* One received message as a JSON line: its headers, and its body (JSON text, or null when empty). */
static void print_message(int copy, natsMsg *msg) {
    const char **keys = NULL;
    int num_keys = 0;
    printf("{\"copy\": %d, \"headers\": {", copy);
    if (natsMsgHeader_Keys(msg, &keys, &num_keys) == NATS_OK) {
        for (int i = 0; i < num_keys; i++) {
            const char *value = "";
            natsMsgHeader_Get(msg, keys[i], &value);
            if (i) printf(", ");
            print_json_string(keys[i]);
            printf(": ");
            print_json_string(value);
        }
        free((void *)keys);
    }
    int len = natsMsg_GetDataLength(msg);
    if (len) printf("}, \"body\": %.*s}\n", len, natsMsg_GetData(msg));
    else printf("}, \"body\": null}\n");
    fflush(stdout);
}

static const char *header_of(natsMsg *msg, const char *name) {
    const char *value = NULL;
    return natsMsgHeader_Get(msg, name, &value) == NATS_OK ? value : NULL;
}

static int fail(natsStatus s, const char *what) {
    fprintf(stderr, "nats error (%s): %s\n", what, natsStatus_GetText(s));
    return 1;
}

int main(int argc, char **argv) {
    const char *subject = "kvbus.v1.generate", *timeout = NULL;
    int cancel_after = 0, copies = 1, probes = 0, messages_mode = 0, opt;
    while ((opt = getopt(argc, argv, "s:t:c:n:pm")) != -1) {
        switch (opt) {
        case 's': subject = optarg; break;
        case 't': timeout = optarg; break;
        case 'c': cancel_after = atoi(optarg); break;
        case 'n': copies = atoi(optarg); break;
        case 'p': probes = 1; break;
        case 'm': messages_mode = 1; break;
        default: return 2;
        }
    }
    char body[16384];
    if (!messages_mode && argc - optind == 3) {
        snprintf(body, sizeof body, "{\"prompt\": \"%s\", \"sampling\": {\"max_tokens\": %s, \"temperature\": 0}}",
                 argv[optind + 1], argv[optind + 2]);
    } else if (messages_mode && argc - optind == 2) {
        snprintf(body, sizeof body, "%s", argv[optind + 1]);
    } else {
        fprintf(stderr, "usage: %s NATS_URL PROMPT MAX_TOKENS\n"
                        "       %s [-s SUBJECT] [-t S] [-c N] [-n COPIES] [-p] -m NATS_URL BODY_JSON\n",
                argv[0], argv[0]);
        return 2;
    }
    if (copies < 1 || copies > MAX_COPIES) {
        fprintf(stderr, "-n must be in [1, %d]\n", MAX_COPIES);
        return 2;
    }

    natsConnection *conn = NULL;
    natsSubscription *sub = NULL;
    natsInbox *inbox = NULL;
    natsStatus s = natsConnection_ConnectTo(&conn, argv[optind]);
    if (s == NATS_OK) s = natsInbox_Create(&inbox);
    char wildcard[256], request_ids[MAX_COPIES][64];
    snprintf(wildcard, sizeof wildcard, "%s.*", (const char *)inbox);
    if (s == NATS_OK) s = natsConnection_SubscribeSync(&sub, conn, wildcard);
    if (s != NATS_OK) return fail(s, "connect");
    /* One reply subject per copy (INBOX.i): the token tells the replies apart. */
    for (int i = 0; i < copies && s == NATS_OK; i++) {
        char reply[300];
        natsMsg *request = NULL;
        snprintf(reply, sizeof reply, "%s.%d", (const char *)inbox, i);
        snprintf(request_ids[i], sizeof request_ids[i], "%s-%d", strrchr((const char *)inbox, '.') + 1, i);
        s = natsMsg_Create(&request, subject, reply, body, (int)strlen(body));
        if (s == NATS_OK) s = natsMsgHeader_Set(request, "Content-Type", "application/json");
        if (s == NATS_OK) s = natsMsgHeader_Set(request, "Kvbus-Request-Id", request_ids[i]);
        if (s == NATS_OK && timeout) s = natsMsgHeader_Set(request, "Kvbus-Timeout", timeout);
        if (s == NATS_OK && probes) s = natsMsgHeader_Set(request, "Kvbus-Probe", "accept");
        if (s == NATS_OK) s = natsConnection_PublishMsg(conn, request);
        natsMsg_Destroy(request);
    }
    if (s != NATS_OK) return fail(s, "publish");

    int num_open = copies, num_chunks[MAX_COPIES] = {0}, is_open[MAX_COPIES], code = 0;
    for (int i = 0; i < copies; i++) is_open[i] = 1;
    while (num_open > 0) {
        natsMsg *msg = NULL;
        s = natsSubscription_NextMsg(&msg, sub, 120000);
        if (s != NATS_OK) {
            fprintf(stderr, "stalled: %s\n", natsStatus_GetText(s));
            return 1;
        }
        int copy = atoi(strrchr(natsMsg_GetSubject(msg), '.') + 1);
        if (copy < 0 || copy >= copies || !is_open[copy]) {
            natsMsg_Destroy(msg);
            continue;
        }
        const char *kind = header_of(msg, "Kvbus-Stream");
        const char *error = header_of(msg, "Kvbus-Error-Code");
        if (messages_mode) print_message(copy, msg);
        if (kind != NULL && strcmp(kind, "probe") == 0) { /* only because we asked (-p): we still read */
            natsMsg *answer = NULL;
            if (natsMsg_GetReply(msg) != NULL
                && natsMsg_Create(&answer, natsMsg_GetReply(msg), NULL, NULL, 0) == NATS_OK) {
                natsMsgHeader_Set(answer, "Kvbus-Stream", "alive");
                natsConnection_PublishMsg(conn, answer);
                natsMsg_Destroy(answer);
            }
            natsMsg_Destroy(msg);
            continue;
        }
        const char *status = header_of(msg, "Status");
        if (error == NULL && status != NULL && strcmp(status, "503") == 0) error = "unavailable (no responders)";
        int is_last = error != NULL || kind == NULL || strcmp(kind, "end") == 0;
        if (error != NULL && !messages_mode) {
            const char *message = header_of(msg, "Kvbus-Error-Message");
            fprintf(stderr, "kvbus error %s: %s\n", error, message ? message : "");
            code = 1;
        } else if (!is_last && !messages_mode) {
            printf("%.*s\n", natsMsg_GetDataLength(msg), natsMsg_GetData(msg));
        }
        if (!is_last && ++num_chunks[copy] == cancel_after) {
            char event[128];
            natsMsg *cancel = NULL;
            snprintf(event, sizeof event, "[\"%s\"]", request_ids[copy]);
            s = natsMsg_Create(&cancel, "kvbus.v1.cancel", NULL, event, (int)strlen(event));
            if (s == NATS_OK) s = natsMsgHeader_Set(cancel, "Content-Type", "application/json");
            if (s == NATS_OK) s = natsConnection_PublishMsg(conn, cancel);
            if (s == NATS_OK) s = natsConnection_FlushTimeout(conn, 5000);
            natsMsg_Destroy(cancel);
            if (s != NATS_OK) return fail(s, "cancel");
            is_last = 1;
        }
        if (is_last) {
            is_open[copy] = 0;
            num_open--;
        }
        natsMsg_Destroy(msg);
    }
    natsSubscription_Destroy(sub);
    natsInbox_Destroy(inbox);
    natsConnection_Destroy(conn);
    nats_Close();
    return code;
}
