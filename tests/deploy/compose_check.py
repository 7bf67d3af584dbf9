"""Checks deploy/compose.yaml the way `docker compose up` would read it,
without a container engine: every dependency names a service, a
service_healthy dependency has a healthcheck, the relay waits for migrate
to complete, every secret a service uses is declared and its file exists,
and no image is unpinned.

    python3 compose_check.py deploy/compose.yaml   # exit 1 and one line per problem
"""
import os
import sys

import yaml


def main(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    base = os.path.dirname(os.path.abspath(path))
    services = doc.get("services") or {}
    secrets = doc.get("secrets") or {}
    problems = []
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, how in deps.items():
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep}")
                continue
            cond = (how or {}).get("condition", "service_started")
            if cond == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
        for s in svc.get("secrets") or []:
            s = s if isinstance(s, str) else s.get("source")
            if s not in secrets:
                problems.append(f"{name}: secret {s} is not declared")
        image = svc.get("image")
        if image is None and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        if image is not None:
            tail = image.rsplit("/", 1)[-1]
            if ":" not in tail or tail.endswith(":latest"):
                problems.append(f"{name}: image {image!r} is not pinned to a version")
    for s, spec in secrets.items():
        f = (spec or {}).get("file")
        if f and not os.path.isfile(os.path.join(base, f)):
            problems.append(f"secret {s}: file {f} does not exist")
    relay = services.get("relay") or {}
    relay_deps = relay.get("depends_on") or {}
    if not isinstance(relay_deps, dict) or (relay_deps.get("migrate") or {}).get(
        "condition"
    ) != "service_completed_successfully":
        problems.append("relay: does not wait for migrate to complete successfully")
    migrate_deps = (services.get("migrate") or {}).get("depends_on") or {}
    if not isinstance(migrate_deps, dict) or (migrate_deps.get("postgres") or {}).get(
        "condition"
    ) != "service_healthy":
        problems.append("migrate: does not wait for a healthy postgres")
    if "healthcheck" not in relay:
        problems.append("relay: no healthcheck")
    for p in problems:
        print(p)
    print(f"{len(services)} services checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
