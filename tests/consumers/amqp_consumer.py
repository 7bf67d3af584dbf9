#!/usr/bin/env python3
"""An independent RabbitMQ consumer (pika) for the end-to-end suites.

Binds a fresh exclusive queue to EXCHANGE with '#', prints "ready", then prints
one JSON line per delivery until COUNT arrived or TIMEOUT seconds passed.

usage: amqp_consumer.py URL EXCHANGE COUNT TIMEOUT
"""
import base64
import json
import sys
import time

import pika


def main():
    url, exchange, count, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    q = ch.queue_declare(queue="", exclusive=True).method.queue
    ch.queue_bind(queue=q, exchange=exchange, routing_key="#")
    print("ready", flush=True)
    deadline = time.monotonic() + timeout
    seen = 0
    for method, props, body in ch.consume(q, inactivity_timeout=0.5):
        if method is not None:
            headers = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in (props.headers or {}).items()}
            print(json.dumps({
                "message_id": props.message_id,
                "routing_key": method.routing_key,
                "content_type": props.content_type,
                "delivery_mode": props.delivery_mode,
                "headers": headers,
                "payload_b64": base64.b64encode(body).decode(),
            }), flush=True)
            ch.basic_ack(method.delivery_tag)
            seen += 1
        if seen >= count or time.monotonic() > deadline:
            break
    conn.close()


if __name__ == "__main__":
    main()
