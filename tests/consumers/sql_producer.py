#!/usr/bin/env python3
"""An app in another language (Python, psycopg) writing outbox rows in its own
transactions: through the SQL function outbox.enqueue, and with a plain
INSERT that leaves message_id to the column's default. Then every invalid
call, each of which must fail with SQLSTATE 22023 and a message naming the
problem, and write nothing.

Prints one JSON line per message written ({"message_id", "payload", "how"}),
then one per refused call ({"refused", "sqlstate", "message"}), then "done".

usage: sql_producer.py DSN SCHEMA EXCHANGE
"""
import json
import sys

import psycopg
from psycopg import sql


def main():
    dsn, schema, exchange = sys.argv[1], sys.argv[2], sys.argv[3]
    s = sql.Identifier(schema)
    with psycopg.connect(dsn) as conn:
        # The two-line version from the README: one statement in the app's
        # own transaction.
        for i in range(20):
            with conn.transaction():
                conn.execute("CREATE TEMP TABLE IF NOT EXISTS orders (id int)")
                conn.execute("INSERT INTO orders VALUES (%s)", (i,))
                payload = json.dumps({"order": i}).encode()
                (mid,) = conn.execute(
                    sql.SQL(
                        "SELECT {}.enqueue(%s, %s, key => %s, routing_key => 'orders.paid', "
                        "headers => %s::jsonb, content_type => 'application/json', "
                        "event_type => 'com.example.order.paid')"
                    ).format(s),
                    (exchange, payload, f"order-{i % 4}", json.dumps({"tenant": "acme"})),
                ).fetchone()
                print(json.dumps({"message_id": str(mid), "payload": payload.decode(), "how": "function"}), flush=True)
        # A plain INSERT: the column default gives a time-ordered id.
        with conn.transaction():
            for i in range(5):
                payload = f"plain-{i}".encode()
                (mid,) = conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.messages (destination, ordering_key, payload) "
                        "VALUES (%s, 'plain', %s) RETURNING message_id"
                    ).format(s),
                    (exchange, payload),
                ).fetchone()
                print(json.dumps({"message_id": str(mid), "payload": payload.decode(), "how": "insert"}), flush=True)
        # A rolled-back call leaves nothing behind.
        try:
            with conn.transaction():
                conn.execute(sql.SQL("SELECT {}.enqueue(%s, %s)").format(s), (exchange, b"rolled back"))
                raise RuntimeError("roll back")
        except RuntimeError:
            pass

        bad = [
            ("empty destination", ("", b"x", None, None, None)),
            ("null destination", (None, b"x", None, None, None)),
            ("null payload", (exchange, None, None, None, None)),
            ("empty header name", (exchange, b"x", {"": "v"}, None, None)),
            ("header name with a space", (exchange, b"x", {"has space": "v"}, None, None)),
            ("header name over 255 bytes", (exchange, b"x", {"h" * 256: "v"}, None, None)),
            ("reserved header", (exchange, b"x", {"Message-Id": "v"}, None, None)),
            ("non-string header value", (exchange, b"x", {"n": 1}, None, None)),
            ("headers not an object", (exchange, b"x", ["a"], None, None)),
            ("payload over the limit", (exchange, b"x" * 2000, None, 1000, None)),
            ("empty event type", (exchange, b"x", None, None, "")),
        ]
        for name, (dest, payload, headers, limit, event_type) in bad:
            try:
                with conn.transaction():
                    conn.execute(
                        sql.SQL(
                            "SELECT {}.enqueue(%s, %s, headers => coalesce(%s::jsonb, '{{}}'::jsonb), "
                            "max_payload_bytes => coalesce(%s, 983040), event_type => %s)"
                        ).format(s),
                        (dest, payload, None if headers is None else json.dumps(headers), limit, event_type),
                    )
                print(json.dumps({"refused": name, "sqlstate": None, "message": "accepted"}), flush=True)
            except psycopg.Error as e:
                print(json.dumps({"refused": name, "sqlstate": e.sqlstate, "message": e.diag.message_primary}), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
