"""Checks Kubernetes manifests against Pod Security "restricted" and the
project's own rules: every pod and container non-root, no privilege
escalation, all capabilities dropped, a RuntimeDefault or Localhost seccomp
profile, a read-only root filesystem, no host namespaces, and images pinned
to a version (never :latest or untagged).

    python3 pod_security.py FILE...    # exit 1 and one line per problem
"""
import sys

import yaml


def pod_specs(doc):
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind == "Pod":
        yield spec
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield spec["template"]["spec"]
    elif kind == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]


def check_pod(where, pod):
    problems = []
    psc = pod.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            problems.append(f"{where}: {host} is set")
    containers = [("container", c) for c in pod.get("containers", [])]
    containers += [("initContainer", c) for c in pod.get("initContainers", [])]
    if not containers:
        problems.append(f"{where}: no containers")
    for kind, c in containers:
        at = f"{where} {kind} {c.get('name')}"
        sc = c.get("securityContext") or {}
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{at}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            problems.append(f"{at}: runs as uid 0")
        if sc.get("privileged"):
            problems.append(f"{at}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{at}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{at}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{at}: adds capabilities {caps.get('add')}")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{at}: seccompProfile is {seccomp!r}, not RuntimeDefault or Localhost")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{at}: root filesystem is writable")
        image = c.get("image", "")
        name = image.rsplit("/", 1)[-1]
        if "@sha256:" not in image and (":" not in name or name.endswith(":latest")):
            problems.append(f"{at}: image {image!r} is not pinned to a version")
    return problems


def main(paths):
    problems, pods = [], 0
    for path in paths:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc:
                    continue
                for pod in pod_specs(doc):
                    pods += 1
                    where = f"{path} {doc['kind']}/{doc['metadata']['name']}"
                    problems += check_pod(where, pod)
    for p in problems:
        print(p)
    if pods == 0:
        print("no pod templates found")
        return 1
    print(f"{pods} pod templates checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
