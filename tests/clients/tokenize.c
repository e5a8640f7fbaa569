/* A kvbus client in C (Debian's libnats-dev): tokenize a text over NATS with JSON.
 *
 *   tokenize NATS_URL TEXT  -> prints the JSON reply, exits 0; non-zero on error.
 */
#include <nats/nats.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s NATS_URL TEXT\n", argv[0]);
        return 2;
    }
    natsConnection *conn = NULL;
    natsMsg *request = NULL, *reply = NULL;
    char body[4096];
    snprintf(body, sizeof body, "{\"text\": \"%s\"}", argv[2]);

    natsStatus s = natsConnection_ConnectTo(&conn, argv[1]);
    if (s == NATS_OK) s = natsMsg_Create(&request, "kvbus.v1.tokenizer.encode", NULL, body, (int)strlen(body));
    if (s == NATS_OK) s = natsMsgHeader_Set(request, "Content-Type", "application/json");
    if (s == NATS_OK) s = natsConnection_RequestMsg(&reply, conn, request, 10000);
    if (s != NATS_OK) {
        fprintf(stderr, "nats error: %s\n", natsStatus_GetText(s));
        return 1;
    }
    const char *code = NULL;
    if (natsMsgHeader_Get(reply, "Kvbus-Error-Code", &code) == NATS_OK) {
        fprintf(stderr, "kvbus error: %s\n", code);
        return 1;
    }
    printf("%.*s\n", natsMsg_GetDataLength(reply), natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    natsMsg_Destroy(request);
    natsConnection_Destroy(conn);
    nats_Close();
    return 0;
}
