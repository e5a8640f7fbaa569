/* Stream a generation from kvbus in C (Debian's libnats-dev).
 *
 *   generate_stream NATS_URL PROMPT MAX_TOKENS
 *
 * Publishes a JSON GenerateRequest on kvbus.v1.generate with a reply inbox, then
 * prints every chunk's JSON on its own line until the message whose header
 * Kvbus-Stream is "end". Messages whose Kvbus-Stream is "probe" (the server asking
 * whether anyone still reads; they may be answered) are skipped. Exits 1 on an
 * error header or a stall of 60 s.
 */
#include <nats/nats.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s NATS_URL PROMPT MAX_TOKENS\n", argv[0]);
        return 2;
    }
    natsConnection *conn = NULL;
    natsSubscription *sub = NULL;
    natsMsg *request = NULL;
    natsInbox *inbox = NULL;
    char body[8192];
    snprintf(body, sizeof body,
             "{\"prompt\": \"%s\", \"sampling\": {\"max_tokens\": %s, \"temperature\": 0}}", argv[2], argv[3]);

    natsStatus s = natsConnection_ConnectTo(&conn, argv[1]);
    if (s == NATS_OK) s = natsInbox_Create(&inbox);
    if (s == NATS_OK) s = natsConnection_SubscribeSync(&sub, conn, inbox);
    if (s == NATS_OK) s = natsMsg_Create(&request, "kvbus.v1.generate", inbox, body, (int)strlen(body));
    if (s == NATS_OK) s = natsMsgHeader_Set(request, "Content-Type", "application/json");
    if (s == NATS_OK) s = natsConnection_PublishMsg(conn, request);
    if (s != NATS_OK) {
        fprintf(stderr, "nats error: %s\n", natsStatus_GetText(s));
        return 1;
    }
    for (;;) {
        natsMsg *msg = NULL;
        s = natsSubscription_NextMsg(&msg, sub, 60000);
        if (s != NATS_OK) {
            fprintf(stderr, "stream stalled: %s\n", natsStatus_GetText(s));
            return 1;
        }
        const char *value = NULL;
        if (natsMsgHeader_Get(msg, "Kvbus-Error-Code", &value) == NATS_OK) {
            const char *message = "";
            natsMsgHeader_Get(msg, "Kvbus-Error-Message", &message);
            fprintf(stderr, "kvbus error %s: %s\n", value, message);
            return 1;
        }
        const char *kind = NULL;
        natsMsgHeader_Get(msg, "Kvbus-Stream", &kind);
        if (kind != NULL && strcmp(kind, "probe") == 0) {
            natsMsg_Destroy(msg);
            continue;
        }
        int is_end = kind != NULL && strcmp(kind, "end") == 0;
        if (!is_end) printf("%.*s\n", natsMsg_GetDataLength(msg), natsMsg_GetData(msg));
        natsMsg_Destroy(msg);
        if (is_end) break;
    }
    natsSubscription_Destroy(sub);
    natsInbox_Destroy(inbox);
    natsMsg_Destroy(request);
    natsConnection_Destroy(conn);
    nats_Close();
    return 0;
}
