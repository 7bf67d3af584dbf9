#!/usr/bin/env python3
"""An independent Kafka consumer (confluent-kafka) for the end-to-end suites.

Reads every partition of TOPIC from the beginning, printing one JSON line per
record until COUNT arrived or TIMEOUT seconds passed.

usage: kafka_consumer.py BROKERS TOPIC PARTITIONS COUNT TIMEOUT
"""
import base64
import json
import sys
import time
import uuid

from confluent_kafka import Consumer, TopicPartition, OFFSET_BEGINNING


def main():
    brokers, topic = sys.argv[1], sys.argv[2]
    partitions, count, timeout = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    c = Consumer({
        "bootstrap.servers": brokers,
        "group.id": "py-" + uuid.uuid4().hex,
        "enable.auto.commit": False,
    })
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    print("ready", flush=True)
    deadline = time.monotonic() + timeout
    seen = 0
    while seen < count and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        headers = {k: (v.decode() if v is not None else None) for k, v in (m.headers() or [])}
        print(json.dumps({
            "message_id": headers.get("message-id"),
            "key": m.key().decode() if m.key() is not None else None,
            "partition": m.partition(),
            "offset": m.offset(),
            "headers": headers,
            "payload_b64": base64.b64encode(m.value() or b"").decode(),
        }), flush=True)
        seen += 1
    c.close()


if __name__ == "__main__":
    main()
