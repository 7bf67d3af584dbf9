#!/usr/bin/env python3
"""Reads what the relay published in CloudEvents binary mode with the Python
`cloudevents` SDK (its RabbitMQ and Kafka protocol bindings), independently of
the relay's code. Prints "ready", then one JSON line per message until COUNT
arrived or TIMEOUT seconds passed.

usage: cloudevents_reader.py amqp  URL     EXCHANGE   COUNT TIMEOUT
       cloudevents_reader.py kafka BROKERS TOPIC PARTITIONS COUNT TIMEOUT
"""
import base64
import datetime
import json
import sys
import time
import uuid

from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def describe(event, relay_message_id, body):
    data = event.get_data()
    return {
        "relay_message_id": relay_message_id,
        "id": event.get_id(),
        "source": event.get_source(),
        "type": event.get_type(),
        "specversion": event.get_specversion(),
        "datacontenttype": event.get_datacontenttype(),
        # Whole microseconds since the epoch, exact (no float rounding).
        "time_us": (event.get_time() - EPOCH) // datetime.timedelta(microseconds=1),
        "data": data if isinstance(data, (dict, list)) else None,
        "payload_b64": base64.b64encode(body).decode(),
    }


def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def amqp(url, exchange, count, timeout):
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    q = ch.queue_declare(queue="", exclusive=True).method.queue
    ch.queue_bind(queue=q, exchange=exchange, routing_key="#")
    print("ready", flush=True)
    deadline = time.monotonic() + timeout
    seen = 0
    for method, props, body in ch.consume(q, inactivity_timeout=0.5):
        if method is not None:
            headers = {k: text(v) for k, v in (props.headers or {}).items()}
            message = ce_rabbitmq.RabbitMQMessage(
                headers=headers, content_type=props.content_type, body=body
            )
            event = ce_rabbitmq.from_binary(message, JSONFormat())
            print(json.dumps(describe(event, props.message_id, body)), flush=True)
            ch.basic_ack(method.delivery_tag)
            seen += 1
        if seen >= count or time.monotonic() > deadline:
            break
    conn.close()


def kafka(brokers, topic, partitions, count, timeout):
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({
        "bootstrap.servers": brokers,
        "group.id": "py-ce-" + uuid.uuid4().hex,
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
        headers = {k: (v if v is not None else b"") for k, v in (m.headers() or [])}
        message = ce_kafka.KafkaMessage(headers=headers, key=m.key(), value=m.value() or b"")
        event = ce_kafka.from_binary(message, JSONFormat())
        relay_id = headers.get("message-id", b"").decode()
        print(json.dumps(describe(event, relay_id, m.value() or b"")), flush=True)
        seen += 1
    c.close()


def main():
    if sys.argv[1] == "amqp":
        amqp(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    else:
        kafka(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))


if __name__ == "__main__":
    main()
