#!/usr/bin/python3
"""Checks of the deployment material (ctest deploy_*), offline.

  check_deploy.py manifests  --root SRC   kustomize builds of deploy/kubernetes,
                                           validated against the Kubernetes API types
                                           (python3-kubernetes) and cross-checked
  check_deploy.py monitoring --root SRC   alert rules (promtool check/test rules),
                                           Grafana dashboard, prometheus-adapter rules
  check_deploy.py dockerfile --root SRC [--binaries BIN...]
                                           Dockerfile structure; the runtime package
                                           list of the built binaries

Each check first proves it can fail: deliberately broken inputs must be
rejected. Exit 0 passed, 1 failed, 77 skipped (a tool is missing: kubectl,
python3-kubernetes, promtool, dpkg).
Run it with Debian's /usr/bin/python3: python3-kubernetes is in its dist-packages.
"""

import argparse
import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

SKIP = 77

# The kustomize directories that must build, and what each one is.
SERVER_BINARY = ""  # --server-binary

KUSTOMIZE_DIRS = {
    "base": "base",
    "cluster": "cluster",
    "overlays/cpu": "cpu",
    "overlays/gpu": "gpu",
    "examples/auth-tls": "cpu",
    "examples/replicated-heads": "cpu",
}

# Metrics being added by other changes (cluster mode, CUDA backend); used when
# the sources do not define them yet.
PENDING_METRICS = {}
# Flags of cluster mode (another change) not yet in server/app/server_flags.cc / worker/main.cc.
PENDING_SERVER_FLAGS = set()
PENDING_WORKER_FLAGS = set()
# Series of other exporters the alert rules may use.
EXTERNAL_SERIES = {"up", "kube_pod_container_status_restarts_total"}


class Failures:
    def __init__(self, what):
        self.what = what
        self.errors = []

    def add(self, msg):
        self.errors.append(msg)

    def report(self):
        for e in self.errors:
            print(f"FAIL [{self.what}] {e}")
        return not self.errors


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------- Kubernetes types

class Schema:
    """Structural validation against the python3-kubernetes models.

    Each model class gives its fields (openapi_types / attribute_map) and its
    required fields (the setters that refuse None). Unknown fields, wrong
    types and missing required fields are errors, as the API server's strict
    field validation reports them.
    """

    # API fields newer than python3-kubernetes 22 (Kubernetes 1.22) that the manifests use.
    EXTRA_FIELDS = {"V1Probe": {"grpc": "X_GRPCAction"}}
    # Types that python3-kubernetes 22 lacks, and the custom resources, in the same form:
    # name -> ({json field: type}, {required json fields}).
    CUSTOM = {
        "X_GRPCAction": ({"port": "int", "service": "str"}, {"port"}),
        # monitoring.coreos.com/v1 (prometheus-operator CRDs), the fields in common use.
        "X_PodMonitor": ({"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta",
                          "spec": "X_PodMonitorSpec"}, {"apiVersion", "kind", "metadata", "spec"}),
        "X_PodMonitorSpec": ({"jobLabel": "str", "podTargetLabels": "list[str]",
                              "podMetricsEndpoints": "list[X_PodMetricsEndpoint]",
                              "selector": "V1LabelSelector", "namespaceSelector": "X_NamespaceSelector",
                              "sampleLimit": "int", "targetLimit": "int", "labelLimit": "int",
                              "attachMetadata": "object"}, {"selector", "podMetricsEndpoints"}),
        "X_NamespaceSelector": ({"any": "bool", "matchNames": "list[str]"}, set()),
        "X_PodMetricsEndpoint": ({"port": "str", "targetPort": "object", "path": "str", "scheme": "str",
                                  "params": "dict(str, list[str])", "interval": "X_Duration",
                                  "scrapeTimeout": "X_Duration", "honorLabels": "bool",
                                  "honorTimestamps": "bool", "relabelings": "list[X_RelabelConfig]",
                                  "metricRelabelings": "list[X_RelabelConfig]", "enableHttp2": "bool",
                                  "followRedirects": "bool", "filterRunning": "bool",
                                  "bearerTokenSecret": "V1SecretKeySelector", "tlsConfig": "object",
                                  "basicAuth": "object", "authorization": "object", "oauth2": "object",
                                  "proxyUrl": "str"}, set()),
        "X_RelabelConfig": ({"sourceLabels": "list[str]", "separator": "str", "targetLabel": "str",
                             "regex": "str", "modulus": "int", "replacement": "str", "action": "str"}, set()),
        "X_PrometheusRule": ({"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta",
                              "spec": "X_PrometheusRuleSpec"}, {"apiVersion", "kind", "metadata", "spec"}),
        "X_PrometheusRuleSpec": ({"groups": "list[X_RuleGroup]"}, set()),
        "X_RuleGroup": ({"name": "str", "interval": "X_Duration", "rules": "list[X_Rule]", "limit": "int",
                         "partial_response_strategy": "str"}, {"name", "rules"}),
        "X_Rule": ({"record": "str", "alert": "str", "expr": "object", "for": "X_Duration",
                    "keep_firing_for": "X_Duration", "labels": "dict(str, str)",
                    "annotations": "dict(str, str)"}, {"expr"}),
    }
    DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")

    KINDS = {
        ("v1", "Namespace"): "V1Namespace",
        ("v1", "ServiceAccount"): "V1ServiceAccount",
        ("v1", "Service"): "V1Service",
        ("v1", "ConfigMap"): "V1ConfigMap",
        ("v1", "Secret"): "V1Secret",
        ("apps/v1", "Deployment"): "V1Deployment",
        ("apps/v1", "StatefulSet"): "V1StatefulSet",
        ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
        # autoscaling/v2 (GA in 1.23) has v2beta2's schema; python3-kubernetes 22 has v2beta2.
        ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2beta2HorizontalPodAutoscaler",
        ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
        ("monitoring.coreos.com/v1", "PodMonitor"): "X_PodMonitor",
        ("monitoring.coreos.com/v1", "PrometheusRule"): "X_PrometheusRule",
    }

    def __init__(self, k8s_client):
        self.k8s = k8s_client
        self.cache = {}

    def fields(self, name):
        """({json field: type}, {required json fields}) of a model or custom type."""
        if name in self.cache:
            return self.cache[name]
        if name in self.CUSTOM:
            result = self.CUSTOM[name]
        else:
            cls = getattr(self.k8s, name, None)
            if cls is None:
                raise KeyError(name)
            types = {cls.attribute_map[a]: t for a, t in cls.openapi_types.items()}
            src = inspect.getsource(cls)
            required = {cls.attribute_map[a] for a in
                        re.findall(r"raise ValueError\(\"Invalid value for `(\w+)`, must not be `None`\"\)", src)
                        if a in cls.attribute_map}
            types.update(self.EXTRA_FIELDS.get(name, {}))
            result = (types, required)
        self.cache[name] = result
        return result

    def check(self, value, typ, path, errs):
        if value is None:
            return  # an explicit null is "unset" for the API server
        if typ == "str":
            if not isinstance(value, str):
                errs.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        elif typ == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                errs.append(f"{path}: expected an integer, got {value!r}")
        elif typ == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errs.append(f"{path}: expected a number, got {value!r}")
        elif typ == "bool":
            if not isinstance(value, bool):
                errs.append(f"{path}: expected a boolean, got {value!r}")
        elif typ in ("datetime", "date"):
            if not isinstance(value, str):
                errs.append(f"{path}: expected a timestamp string, got {value!r}")
        elif typ == "object":
            pass  # IntOrString, RawExtension, free-form
        elif typ == "X_Duration":
            if not isinstance(value, str) or not self.DURATION.match(value):
                errs.append(f"{path}: expected a Prometheus duration (e.g. 30s), got {value!r}")
        elif typ.startswith("list["):
            if not isinstance(value, list):
                errs.append(f"{path}: expected a list, got {type(value).__name__}")
                return
            for i, item in enumerate(value):
                self.check(item, typ[5:-1], f"{path}[{i}]", errs)
        elif typ.startswith("dict("):
            inner = typ[typ.index(",") + 1:-1].strip()
            if not isinstance(value, dict):
                errs.append(f"{path}: expected a map, got {type(value).__name__}")
                return
            for k, v in value.items():
                if not isinstance(k, str):
                    errs.append(f"{path}: map key {k!r} is not a string")
                self.check(v, inner, f"{path}.{k}", errs)
        else:
            types, required = self.fields(typ)
            if not isinstance(value, dict):
                errs.append(f"{path}: expected an object ({typ}), got {type(value).__name__} {value!r}")
                return
            for k, v in value.items():
                if k not in types:
                    errs.append(f"{path}: unknown field {k!r} ({typ})")
                    continue
                self.check(v, types[k], f"{path}.{k}", errs)
            for k in sorted(required):
                if k not in value or value[k] is None:
                    errs.append(f"{path}: missing required field {k!r} ({typ})")

    def validate(self, obj):
        """Errors of one object."""
        if not isinstance(obj, dict):
            return [f"not an object: {obj!r}"]
        key = (obj.get("apiVersion"), obj.get("kind"))
        name = (obj.get("metadata") or {}).get("name", "?")
        where = f"{key[1]}/{name}"
        if key not in self.KINDS:
            return [f"{where}: unexpected apiVersion/kind {key}"]
        if not name or name == "?":
            return [f"{where}: metadata.name missing"]
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
            return [f"{where}: metadata.name is not a DNS-1123 label"]
        errs = []
        self.check(obj, self.KINDS[key], where, errs)
        return errs


# ----------------------------------------------------------------------------- cross checks

def source_flags(root, rel):
    with open(os.path.join(root, rel)) as f:
        return set(re.findall(r"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)\s*,", f.read()))


def parse_flags(args):
    """--flag value pairs (and --flag=value) -> {flag_with_underscores: [values]}; errors."""
    out, errs = {}, []
    i = 0
    while i < len(args):
        a = str(args[i])
        if not a.startswith("--"):
            errs.append(f"argument {a!r} is not a --flag")
            i += 1
            continue
        if "=" in a:
            name, value = a[2:].split("=", 1)
            i += 1
        else:
            name = a[2:]
            if i + 1 >= len(args) or str(args[i + 1]).startswith("--"):
                errs.append(f"--{name} has no value")
                i += 1
                continue
            value = str(args[i + 1])
            i += 2
        out.setdefault(name.replace("-", "_"), []).append(value)
    return out, errs


QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q):
    """A Kubernetes memory quantity ("16Gi", "512M", "1000") in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(q))
    if not m:
        raise ValueError(f"memory quantity {q!r}")
    return int(float(m.group(1)) * QUANTITY_UNITS.get(m.group(2) or "", 1))


def memory_bound(server_binary, args):
    """The front-end's memory bound for `args` from `logprob-server
    --print-memory-bound` (the formula lives in server/app/memory_bound.cc
    only): {frontend_bytes, local_workers, worker_base_bytes}, and the line."""
    r = subprocess.run([server_binary, "--print-memory-bound"] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"logprob-server --print-memory-bound exited {r.returncode}: {r.stderr.strip()}")
    fields = dict(kv.split("=", 1) for kv in r.stdout.split(" (", 1)[0].split())
    return {k: int(v) for k, v in fields.items()}, r.stdout.strip()


def labels_match(selector, labels):
    ml = (selector or {}).get("matchLabels", selector or {})
    return bool(ml) and all((labels or {}).get(k) == v for k, v in ml.items())


def pod_templates(objs):
    for o in objs:
        if o.get("kind") in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]


def cross_check(objs, flavour, root, fail):
    """Consistency of one kustomize build: selectors, ports, probes, flags, security."""
    by_kind = {}
    for o in objs:
        key = (o.get("kind"), o.get("metadata", {}).get("name"))
        if key in by_kind:
            fail.add(f"{key[0]}/{key[1]} defined twice")
        by_kind[key] = o
    server_flags = source_flags(root, "server/app/server_flags.cc") | PENDING_SERVER_FLAGS
    worker_flags = source_flags(root, "worker/main.cc") | PENDING_WORKER_FLAGS
    service_accounts = {n for k, n in by_kind if k == "ServiceAccount"}
    workloads = list(pod_templates(objs))
    if not workloads:
        fail.add("no Deployment or StatefulSet")

    frontend = by_kind.get(("Deployment", "logprob-frontend"))
    workers = by_kind.get(("StatefulSet", "logprob-worker"))
    if frontend is None:
        fail.add("no Deployment logprob-frontend")

    for wl, tpl in workloads:
        where = f"{wl['kind']}/{wl['metadata']['name']}"
        if not labels_match(wl["spec"].get("selector"), tpl.get("metadata", {}).get("labels")):
            fail.add(f"{where}: selector does not match the pod template's labels")
        spec = tpl.get("spec", {})
        sa = spec.get("serviceAccountName")
        if sa and sa not in service_accounts:
            fail.add(f"{where}: serviceAccountName {sa} is not defined")
        psc = spec.get("securityContext") or {}
        if psc.get("runAsNonRoot") is not True:
            fail.add(f"{where}: pod securityContext.runAsNonRoot is not true")
        if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            fail.add(f"{where}: pod seccompProfile is not RuntimeDefault")
        volumes = {v["name"] for v in spec.get("volumes") or []}
        for c in spec.get("containers") or []:
            cw = f"{where} container {c.get('name')}"
            sc = c.get("securityContext") or {}
            if sc.get("readOnlyRootFilesystem") is not True:
                fail.add(f"{cw}: readOnlyRootFilesystem is not true")
            if sc.get("allowPrivilegeEscalation") is not False:
                fail.add(f"{cw}: allowPrivilegeEscalation is not false")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                fail.add(f"{cw}: capabilities.drop lacks ALL")
            res = c.get("resources") or {}
            for need in ("requests.cpu", "requests.memory", "limits.memory"):
                a, b = need.split(".")
                if b not in (res.get(a) or {}):
                    fail.add(f"{cw}: resources.{need} missing")
            gpu_req = (res.get("requests") or {}).get("nvidia.com/gpu")
            gpu_lim = (res.get("limits") or {}).get("nvidia.com/gpu")
            if gpu_req != gpu_lim:
                fail.add(f"{cw}: nvidia.com/gpu requests {gpu_req} != limits {gpu_lim}")
            if flavour != "gpu" and (gpu_req or gpu_lim):
                fail.add(f"{cw}: requests a GPU in a {flavour} build")
            for m in c.get("volumeMounts") or []:
                if m.get("name") not in volumes:
                    fail.add(f"{cw}: volumeMount {m.get('name')} has no volume")
            env = {e["name"] for e in c.get("env") or []}
            for s in (c.get("command") or []) + (c.get("args") or []):
                for var in re.findall(r"\$\((\w+)\)", str(s)):
                    if var not in env:
                        fail.add(f"{cw}: $({var}) is not defined in env (Kubernetes would pass it literally)")
            ports = {p.get("containerPort") for p in c.get("ports") or []}
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_name)
                if probe and "grpc" in probe and probe["grpc"].get("port") not in ports:
                    fail.add(f"{cw}: {probe_name} grpc port {probe['grpc'].get('port')} is not a container port")
            cmd = (c.get("command") or [""])[0]
            flags, ferrs = parse_flags(c.get("args") or [])
            for e in ferrs:
                fail.add(f"{cw}: {e}")
            if cmd == "logprob-server":
                for f in flags:
                    if f not in server_flags:
                        fail.add(f"{cw}: logprob-server has no flag --{f}")
                if flags.get("listen") != ["0.0.0.0:50051"]:
                    fail.add(f"{cw}: --listen is not 0.0.0.0:50051")
                if flags.get("metrics_listen") != ["0.0.0.0:9464"]:
                    fail.add(f"{cw}: --metrics-listen is not 0.0.0.0:9464")
                if {50051, 9464} - ports:
                    fail.add(f"{cw}: container ports lack 50051 / 9464")
                for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if not c.get(probe_name):
                        fail.add(f"{cw}: no {probe_name}")
                limit = (res.get("limits") or {}).get("memory")
                if SERVER_BINARY and limit:
                    # The container's limit covers the front-end's bound and its local workers' base.
                    try:
                        bound, line = memory_bound(SERVER_BINARY, c.get("args") or [])
                        need = bound["frontend_bytes"] + bound["local_workers"] * bound["worker_base_bytes"]
                        have = quantity_bytes(limit)
                        if have < need:
                            fail.add(f"{cw}: limits.memory {limit} is below the memory bound of its flags, "
                                     f"{need / 2**30:.1f} GiB: {line}")
                    except (RuntimeError, ValueError, KeyError) as e:
                        fail.add(f"{cw}: {e}")
            elif cmd == "logprob-worker":
                for f in flags:
                    if f not in worker_flags:
                        fail.add(f"{cw}: logprob-worker has no flag --{f}")
                if flavour == "gpu":
                    if gpu_lim != "1":
                        fail.add(f"{cw}: a GPU worker must request nvidia.com/gpu: 1")
                    if flags.get("backend") != ["cuda"]:
                        fail.add(f"{cw}: a GPU worker runs --backend cuda")
            else:
                fail.add(f"{cw}: command {cmd!r} is neither logprob-server nor logprob-worker")

    def selected(selector):
        return [(wl, tpl) for wl, tpl in workloads if labels_match(selector, tpl["metadata"].get("labels"))]

    for (kind, name), o in by_kind.items():
        where = f"{kind}/{name}"
        spec = o.get("spec") or {}
        if kind == "Service":
            sel = selected(spec.get("selector"))
            if not sel:
                fail.add(f"{where}: selector matches no pod template")
            for p in spec.get("ports") or []:
                tp = p.get("targetPort", p.get("port"))
                found = any(
                    (cp.get("name") == tp if isinstance(tp, str) else cp.get("containerPort") == tp)
                    for _, tpl in sel for c in tpl["spec"]["containers"] for cp in c.get("ports") or [])
                if not found:
                    fail.add(f"{where}: port {p.get('name')} targets {tp!r}, which no selected container has")
        elif kind == "PodDisruptionBudget":
            if not selected(spec.get("selector")):
                fail.add(f"{where}: selector matches no pod template")
        elif kind == "PodMonitor":
            sel = selected(spec.get("selector"))
            if not sel:
                fail.add(f"{where}: selector matches no pod template")
            for ep in spec.get("podMetricsEndpoints") or []:
                if not any(cp.get("name") == ep.get("port") for _, tpl in sel
                           for c in tpl["spec"]["containers"] for cp in c.get("ports") or []):
                    fail.add(f"{where}: port {ep.get('port')!r} is no selected container's port name")
        elif kind == "HorizontalPodAutoscaler":
            ref = spec.get("scaleTargetRef") or {}
            if (ref.get("kind"), ref.get("name")) not in by_kind:
                fail.add(f"{where}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} is not in the build")
            if spec.get("minReplicas", 1) > spec.get("maxReplicas", 0):
                fail.add(f"{where}: minReplicas > maxReplicas")
            if (ref.get("kind"), ref.get("name")) == ("Deployment", "logprob-frontend") and workers is not None:
                fail.add(f"{where}: the front-end of a cluster-mode group must not be scaled (one per worker group)")

    # Cluster mode: front-end <-> worker StatefulSet.
    if frontend is not None:
        fc = frontend["spec"]["template"]["spec"]["containers"][0]
        fflags, _ = parse_flags(fc.get("args") or [])
        if workers is None:
            if "external_workers" in fflags:
                fail.add("--external-workers without a worker StatefulSet")
        else:
            replicas = workers["spec"].get("replicas", 1)
            if fflags.get("external_workers") != [str(replicas)]:
                fail.add(f"--external-workers {fflags.get('external_workers')} != worker StatefulSet replicas {replicas}")
            if "workers" in fflags:
                fail.add("--workers (local workers) together with --external-workers")
            if frontend["spec"].get("replicas", 1) != 1:
                fail.add("a cluster-mode front-end must run 1 replica")
            if (frontend["spec"].get("strategy") or {}).get("type") != "Recreate":
                fail.add("a cluster-mode front-end must use the Recreate strategy")
            control = (fflags.get("control_listen") or [""])[0]
            if not control.startswith("0.0.0.0:"):
                fail.add(f"--control-listen {control!r} is not on 0.0.0.0")
            control_port = int(control.rsplit(":", 1)[-1] or 0)
            if control_port not in {p.get("containerPort") for p in fc.get("ports") or []}:
                fail.add(f"control port {control_port} is not a front-end container port")
            wt = workers["spec"]["template"]
            if workers["spec"].get("serviceName") != "logprob-worker" or \
                    by_kind.get(("Service", "logprob-worker"), {}).get("spec", {}).get("clusterIP") != "None":
                fail.add("the worker StatefulSet needs its headless Service logprob-worker (clusterIP: None)")
            wc = wt["spec"]["containers"][0]
            wflags, _ = parse_flags(wc.get("args") or [])
            target = (wflags.get("frontend") or [""])[0]
            host, _, port = target.partition(":")
            svc = by_kind.get(("Service", host))
            if svc is None:
                fail.add(f"worker --frontend {target!r}: no Service {host!r}")
            else:
                if not labels_match(svc["spec"].get("selector"), frontend["spec"]["template"]["metadata"]["labels"]):
                    fail.add(f"Service {host} does not select the front-end")
                if not port.isdigit() or int(port) not in {p.get("port") for p in svc["spec"].get("ports") or []}:
                    fail.add(f"Service {host} has no port {port}")
                if svc["spec"].get("publishNotReadyAddresses") is not True:
                    fail.add(f"Service {host}: publishNotReadyAddresses must be true "
                             "(the front-end is not Ready until the workers joined)")
            if wflags.get("advertise_host") != ["$(POD_IP)"]:
                fail.add("workers must advertise $(POD_IP)")
            # The internal plane (docs/security.md): front-end and workers
            # read the same pool secret, mounted from one Secret, not
            # readable by other users; NetworkPolicies keep the plane in.
            secrets_seen = []
            for who, c, flags, tmpl in (("front-end", fc, fflags, frontend["spec"]["template"]),
                                        ("worker", wc, wflags, wt)):
                path = (flags.get("internal_secret_file") or [""])[-1]
                if not path:
                    fail.add(f"{who}: cluster mode needs --internal-secret-file (the pool secret)")
                    continue
                vols = {v["name"]: v for v in tmpl["spec"].get("volumes") or []}
                mount = next((m for m in c.get("volumeMounts") or []
                              if path.startswith(m.get("mountPath", "").rstrip("/") + "/")), None)
                secret = (vols.get(mount["name"]) or {}).get("secret") if mount else None
                if not secret:
                    fail.add(f"{who}: --internal-secret-file {path} is not in a mounted Secret")
                    continue
                if (secret.get("defaultMode", 0o644) & 0o004) != 0:
                    fail.add(f"{who}: the pool secret's volume must not be readable by others (defaultMode 0400)")
                secrets_seen.append((secret.get("secretName"), path.rsplit("/", 1)[-1]))
            if len(secrets_seen) == 2 and secrets_seen[0] != secrets_seen[1]:
                fail.add(f"front-end and workers read different pool secrets: {secrets_seen}")
            if "insecure_internal_plane" in fflags or "insecure_internal_plane" in wflags:
                fail.add("--insecure-internal-plane in a manifest")
            if ("NetworkPolicy", "logprob-worker-internal") not in by_kind:
                fail.add("cluster mode needs the NetworkPolicy logprob-worker-internal (Gloo's sockets)")
            pod_ip = [e for e in wc.get("env") or [] if e.get("name") == "POD_IP"]
            if not pod_ip or ((pod_ip[0].get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") != "status.podIP":
                fail.add("POD_IP must come from the downward API (fieldRef status.podIP)")

    # Replicated front-ends with updatable heads (docs/lm-head-updates.md "What
    # replicas see"): each replica catches up from the others through a headless
    # Service that lists every front-end, not-Ready ones too.
    if frontend is not None:
        fflags, _ = parse_flags(frontend["spec"]["template"]["spec"]["containers"][0].get("args") or [])
        scaled = frontend["spec"].get("replicas", 1) > 1 or any(
            o.get("kind") == "HorizontalPodAutoscaler" and
            (o["spec"].get("scaleTargetRef") or {}).get("name") == "logprob-frontend" for o in objs)
        updates = fflags.get("allow_lm_head_updates", ["false"])[-1] in ("", "true", "1")
        sync = (fflags.get("lm_head_sync_from") or [""])[-1]
        if scaled and updates and not sync:
            fail.add("replicated front-ends with --allow-lm-head-updates need --lm-head-sync-from "
                     "(a replica started later would serve its start-up heads under the updated names)")
        if sync:
            if not updates:
                fail.add("--lm-head-sync-from needs --allow-lm-head-updates")
            host, _, port = (sync[len("dns:///"):] if sync.startswith("dns:///") else sync).rpartition(":")
            svc = by_kind.get(("Service", host.split(".")[0]))
            if svc is None:
                fail.add(f"--lm-head-sync-from {sync!r}: no Service {host.split('.')[0]!r}")
            else:
                sspec = svc.get("spec") or {}
                if sspec.get("clusterIP") != "None":
                    fail.add(f"--lm-head-sync-from {sync!r}: Service {host} is not headless (clusterIP: None)")
                if sspec.get("publishNotReadyAddresses") is not True:
                    fail.add(f"--lm-head-sync-from {sync!r}: Service {host} needs publishNotReadyAddresses: true "
                             "(updates must reach replicas still catching up)")
                if not labels_match(sspec.get("selector"), frontend["spec"]["template"]["metadata"]["labels"]):
                    fail.add(f"--lm-head-sync-from {sync!r}: Service {host} does not select the front-end")
                if not port.isdigit() or int(port) not in {p.get("port") for p in sspec.get("ports") or []}:
                    fail.add(f"--lm-head-sync-from {sync!r}: Service {host} has no port {port}")

    kinds = {k for k, _ in by_kind}
    for need in ("Service", "Deployment", "PodDisruptionBudget", "PodMonitor"):
        if need not in kinds:
            fail.add(f"no {need}")
    if flavour == "cpu" and "HorizontalPodAutoscaler" not in kinds and "overlays" in fail.what:
        fail.add("the cpu overlay has no HorizontalPodAutoscaler")
    if flavour == "gpu" and workers is None:
        fail.add("the gpu overlay has no worker StatefulSet")


# ----------------------------------------------------------------------------- manifests

def kustomize(kubectl, path):
    r = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def validate_build(schema, objs, flavour, root, what):
    fail = Failures(what)
    for o in objs:
        for e in schema.validate(o):
            fail.add(e)
    if not fail.errors:
        cross_check(objs, flavour, root, fail)
    return fail


def adapter_rules(root):
    with open(os.path.join(root, "deploy/monitoring/prometheus-adapter-config.yaml")) as f:
        cm = yaml.safe_load(f)
    return cm, yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def self_test_replicas(schema, good, root):
    """The replica rules must reject a replicated, updatable front-end that
    cannot catch up; returns the self-test's own errors."""
    def fe_args(objs):
        dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "logprob-frontend")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    def svc(objs):
        return next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "logprob-headless")

    def drop_sync(objs):
        args = fe_args(objs)
        i = args.index("--lm-head-sync-from")
        del args[i:i + 2]

    mutations = {
        "updatable replicas without --lm-head-sync-from": drop_sync,
        "sync Service without publishNotReadyAddresses": lambda o: svc(o)["spec"].pop("publishNotReadyAddresses"),
        "sync Service with a cluster IP": lambda o: svc(o)["spec"].pop("clusterIP"),
        "sync target naming a missing Service": lambda o: fe_args(o).__setitem__(
            fe_args(o).index("--lm-head-sync-from") + 1, "dns:///logprob-peers:50051"),
    }
    problems = []
    for what, mutate in mutations.items():
        objs = copy.deepcopy(good)
        mutate(objs)
        if not validate_build(schema, objs, "cpu", root, "self-test").errors:
            problems.append(f"self-test: a manifest with '{what}' was accepted")
    return problems


def self_test_manifests(schema, good, root, kubectl):
    """The checks must reject broken manifests; returns the errors of the self-test itself."""
    problems = []

    def find(objs, kind, name):
        return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)

    def fe(objs):
        return find(objs, "Deployment", "logprob-frontend")["spec"]["template"]["spec"]["containers"][0]

    def wk(objs):
        return find(objs, "StatefulSet", "logprob-worker")["spec"]["template"]["spec"]["containers"][0]

    mutations = {
        "unknown field spec.replica": lambda o: find(o, "Deployment", "logprob-frontend")["spec"].update(replica=3),
        "replicas as a string": lambda o: find(o, "StatefulSet", "logprob-worker")["spec"].update(replicas="2"),
        "container without a name": lambda o: fe(o).pop("name"),
        "grpc probe with a misspelt port": lambda o: fe(o)["livenessProbe"].update(grpc={"prot": 50051}),
        "grpc probe on a port the container lacks": lambda o: fe(o)["readinessProbe"].update(grpc={"port": 50053}),
        "PodMonitor podMetricEndpoints typo": lambda o: find(o, "PodMonitor", "logprob")["spec"].update(
            podMetricEndpoints=find(o, "PodMonitor", "logprob")["spec"].pop("podMetricsEndpoints")),
        "PodMonitor interval not a duration": lambda o: find(o, "PodMonitor", "logprob")["spec"][
            "podMetricsEndpoints"][0].update(interval="15 seconds"),
        "Service port name a container lacks": lambda o: find(o, "Service", "logprob")["spec"]["ports"][0].update(
            targetPort="grpcc"),
        "Service selector matching nothing": lambda o: find(o, "Service", "logprob")["spec"].update(
            selector={"app.kubernetes.io/name": "other"}),
        "label value not a string": lambda o: find(o, "Service", "logprob")["metadata"]["labels"].update(
            version=1),
        "--external-workers != replicas": lambda o: find(o, "StatefulSet", "logprob-worker")["spec"].update(replicas=3),
        "unknown server flag": lambda o: fe(o)["args"].extend(["--metric-listen", "0.0.0.0:9464"]),
        "unknown worker flag": lambda o: wk(o)["args"].extend(["--front-end", "x:1"]),
        "control Service without publishNotReadyAddresses": lambda o: find(
            o, "Service", "logprob-frontend-control")["spec"].pop("publishNotReadyAddresses"),
        "$(POD_IP) without env": lambda o: wk(o).pop("env"),
        "runAsNonRoot removed": lambda o: find(o, "StatefulSet", "logprob-worker")["spec"]["template"]["spec"][
            "securityContext"].pop("runAsNonRoot"),
        "writable root filesystem": lambda o: fe(o)["securityContext"].update(readOnlyRootFilesystem=False),
        "GPU request != limit": lambda o: wk(o)["resources"]["requests"].update({"nvidia.com/gpu": "2"}),
        "volumeMount without volume": lambda o: wk(o)["volumeMounts"].append({"name": "nope", "mountPath": "/x"}),
        "memory limit missing": lambda o: wk(o)["resources"]["limits"].pop("memory"),
        "PDB without selector": lambda o: find(o, "PodDisruptionBudget", "logprob-worker")["spec"].pop("selector"),
        "unknown kind": lambda o: o.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}),
        "worker without the pool secret": lambda o: wk(o).update(
            args=[a for a in wk(o)["args"] if "secret" not in a]),
        "pool secret readable by others": lambda o: [v for v in find(o, "StatefulSet", "logprob-worker")["spec"][
            "template"]["spec"]["volumes"] if v["name"] == "pool-secret"][0]["secret"].update(defaultMode=0o644),
        "insecure internal plane": lambda o: fe(o)["args"].append("--insecure-internal-plane"),
    }
    if SERVER_BINARY:
        mutations["front-end memory limit below its bound"] = lambda o: fe(o)["resources"]["limits"].update(
            memory="4Gi")
    for what, mutate in mutations.items():
        objs = copy.deepcopy(good)
        mutate(objs)
        fail = validate_build(schema, objs, "gpu", root, "self-test")
        if not fail.errors:
            problems.append(f"self-test: a manifest with '{what}' was accepted")
    hpa_mutations = {
        "HPA without scaleTargetRef": lambda h: h["spec"].pop("scaleTargetRef"),
        "HPA metric target with a typo": lambda h: h["spec"]["metrics"][0]["pods"]["target"].update(averageValu="1"),
    }
    with open(os.path.join(root, "deploy/kubernetes/overlays/cpu/hpa.yaml")) as f:
        hpa = yaml.safe_load(f)
    if schema.validate(hpa):
        problems.append(f"self-test: hpa.yaml alone is rejected: {schema.validate(hpa)}")
    for what, mutate in hpa_mutations.items():
        h = copy.deepcopy(hpa)
        mutate(h)
        if not schema.validate(h):
            problems.append(f"self-test: a manifest with '{what}' was accepted")
    # kustomize itself must fail on a patch whose target does not exist.
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "kustomization.yaml"), "w") as f:
            f.write("resources:\n- cm.yaml\npatchesStrategicMerge:\n- patch.yaml\n")
        with open(os.path.join(d, "cm.yaml"), "w") as f:
            f.write("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n")
        with open(os.path.join(d, "patch.yaml"), "w") as f:
            f.write("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: missing\nspec:\n  replicas: 2\n")
        rc, _, _ = kustomize(kubectl, d)
        if rc == 0:
            problems.append("self-test: kubectl kustomize accepted a patch of a missing resource")
    return problems


def cmd_manifests(root):
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not kubectl:
        log("SKIP: kubectl not found (Debian: kubernetes-client; scripts/install-deps.sh installs it)")
        return SKIP
    try:
        from kubernetes import client as k8s_client
    except ImportError:
        log("SKIP: python3-kubernetes not installed (scripts/install-deps.sh installs it)")
        return SKIP
    version = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True).stdout.strip()
    log(f"kubectl: {kubectl}: {version.splitlines()[0] if version else '?'}")
    schema = Schema(k8s_client)
    ok = True
    builds = {}
    kroot = os.path.join(root, "deploy/kubernetes")
    for rel, flavour in KUSTOMIZE_DIRS.items():
        rc, out, err = kustomize(kubectl, os.path.join(kroot, rel))
        if rc != 0:
            print(f"FAIL [kustomize {rel}] kubectl kustomize exited {rc}:\n{err}")
            ok = False
            continue
        objs = [o for o in yaml.safe_load_all(out) if o]
        builds[rel] = objs
        fail = validate_build(schema, objs, flavour, root, f"kustomize {rel}")
        ok &= fail.report()
        log(f"{'ok' if not fail.errors else 'FAILED'}: kustomize {rel}: {len(objs)} objects: "
            + ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objs))
    if "overlays/cpu" in builds:
        for o in builds["overlays/cpu"]:
            if o["kind"] == "HorizontalPodAutoscaler":
                _, rules = adapter_rules(root)
                names = {r["name"]["as"] for r in rules}
                for m in o["spec"].get("metrics") or []:
                    if m["type"] == "Pods" and m["pods"]["metric"]["name"] not in names:
                        print(f"FAIL [hpa] Pods metric {m['pods']['metric']['name']} is no prometheus-adapter rule's name")
                        ok = False
    # Manifests outside kustomize: the adapter ConfigMap and the PrometheusRule wrapper.
    cm, _ = adapter_rules(root)
    fail = Failures("prometheus-adapter-config.yaml")
    for e in schema.validate(cm):
        fail.add(e)
    ok &= fail.report()
    r = subprocess.run(["bash", os.path.join(root, "deploy/monitoring/prometheusrule.sh")],
                       capture_output=True, text=True, env=dict(os.environ, EXTRA_LABELS="release: x"))
    fail = Failures("prometheusrule.sh")
    if r.returncode != 0:
        fail.add(f"exited {r.returncode}: {r.stderr}")
    else:
        pr = yaml.safe_load(r.stdout)
        for e in schema.validate(pr):
            fail.add(e)
        with open(os.path.join(root, "deploy/monitoring/alerts.yaml")) as f:
            if pr.get("spec") != yaml.safe_load(f):
                fail.add("the PrometheusRule's spec is not alerts.yaml")
        if pr["metadata"]["labels"].get("release") != "x":
            fail.add("EXTRA_LABELS not applied")
    ok &= fail.report()
    log("ok: prometheus-adapter ConfigMap, PrometheusRule wrapper" if ok else "")
    if "examples/replicated-heads" in builds:
        problems = self_test_replicas(schema, builds["examples/replicated-heads"], root)
        for p in problems:
            print(f"FAIL [{p}]")
        ok &= not problems
    if "overlays/gpu" in builds:
        problems = self_test_manifests(schema, builds["overlays/gpu"], root, kubectl)
        for p in problems:
            print(f"FAIL [{p}]")
        ok &= not problems
        log(f"{'ok' if not problems else 'FAILED'}: self-test: broken manifests rejected")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- monitoring

def known_metrics(root):
    """{name: type} from the sources, plus the pending ones."""
    metrics = dict(PENDING_METRICS)
    pattern = re.compile(r"Build(Counter|Gauge|Histogram|Summary)\(\)\s*\.Name\(\s*\"(\w+)\"")
    for d in ("server", "worker", "common"):
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for fn in files:
                if fn.endswith((".cc", ".h")):
                    with open(os.path.join(dirpath, fn)) as f:
                        for kind, name in pattern.findall(f.read()):
                            metrics[name] = kind.lower()
    return metrics


def series_names(metrics):
    out = {}
    for name, kind in metrics.items():
        if kind == "histogram" or kind == "summary":
            for s in ("_bucket", "_sum", "_count"):
                out[name + s] = name
        else:
            out[name] = name
    return out


def expr_metric_errors(expr, series, metrics):
    """(base metric names used, errors) of one PromQL expression."""
    used, errs = set(), []
    for tok in re.findall(r"\b(logprob_[a-z0-9_]+)\b", expr):
        if tok in series:
            used.add(series[tok])
        elif tok in metrics:
            errs.append(f"{tok} is a {metrics[tok]}: use {tok}_bucket/_sum/_count")
        else:
            errs.append(f"unknown metric {tok}")
    return used, errs


GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}


def check_dashboard(dash, series, metrics, fail):
    required = {"logprob_requests_total", "logprob_request_duration_seconds", "logprob_queue_duration_seconds",
                "logprob_tokens_scored_total", "logprob_batch_tokens", "logprob_workers_up",
                "logprob_gpu_memory_bytes", "logprob_worker_restarts_total", "logprob_inflight_requests"}
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in dash:
            fail.add(f"dashboard: no {key}")
    variables = {v.get("name") for v in (dash.get("templating") or {}).get("list", [])}
    ids, used = set(), set()
    panels = list(dash.get("panels") or [])
    for p in list(panels):
        panels.extend(p.get("panels") or [])  # panels of collapsed rows
    for p in panels:
        title = p.get("title", "?")
        if p.get("id") in ids:
            fail.add(f"panel {title!r}: id {p.get('id')} used twice")
        ids.add(p.get("id"))
        if "gridPos" not in p:
            fail.add(f"panel {title!r}: no gridPos")
        if p.get("type") == "row":
            continue
        targets = p.get("targets") or []
        if not targets:
            fail.add(f"panel {title!r}: no query")
        for t in targets:
            expr = t.get("expr") or ""
            if not expr.strip():
                fail.add(f"panel {title!r} {t.get('refId')}: empty query")
                continue
            u, errs = expr_metric_errors(expr, series, metrics)
            for e in errs:
                fail.add(f"panel {title!r} {t.get('refId')}: {e}")
            if not u:
                fail.add(f"panel {title!r} {t.get('refId')}: the query names no logprob metric: {expr}")
            used |= u
            for var in re.findall(r"\$\{?(\w+)", expr):
                if var not in variables and var not in GRAFANA_BUILTINS:
                    fail.add(f"panel {title!r}: undefined variable ${var}")
            ds = (t.get("datasource") or p.get("datasource") or {}).get("uid", "")
            if ds.startswith("$") and ds.strip("${}") not in variables:
                fail.add(f"panel {title!r}: data source {ds} is no dashboard variable")
    for m in sorted(required - used):
        fail.add(f"dashboard: no panel shows {m}")
    return used


def check_rules_metrics(rules_doc, series, metrics, fail):
    for g in rules_doc.get("groups") or []:
        for r in g.get("rules") or []:
            name = r.get("alert") or r.get("record")
            expr = str(r.get("expr", ""))
            used, errs = expr_metric_errors(expr, series, metrics)
            for e in errs:
                fail.add(f"rule {name}: {e}")
            external = {t for t in re.findall(r"\b([a-z_:][a-z0-9_:]*)\s*[{\[]", expr) if t in EXTERNAL_SERIES}
            if not used and not external:
                fail.add(f"rule {name}: names no logprob metric: {expr}")
            if r.get("alert") and not (r.get("labels") or {}).get("severity"):
                fail.add(f"rule {name}: no severity label")


def cmd_monitoring(root):
    mon = os.path.join(root, "deploy/monitoring")
    metrics = known_metrics(root)
    series = series_names(metrics)
    log(f"metrics: {len(metrics)} ({', '.join(sorted(metrics))})")
    ok = True

    fail = Failures("grafana-dashboard.json")
    try:
        with open(os.path.join(mon, "grafana-dashboard.json")) as f:
            dash = json.load(f)
    except (OSError, ValueError) as e:
        fail.add(f"does not parse: {e}")
        dash = None
    if dash is not None:
        used = check_dashboard(dash, series, metrics, fail)
        log(f"dashboard: {len(dash.get('panels', []))} panels, metrics {', '.join(sorted(used))}")
    ok &= fail.report()

    fail = Failures("alerts.yaml")
    with open(os.path.join(mon, "alerts.yaml")) as f:
        rules = yaml.safe_load(f)
    check_rules_metrics(rules, series, metrics, fail)
    ok &= fail.report()

    fail = Failures("prometheus-adapter-config.yaml")
    _, adapter = adapter_rules(root)
    for r in adapter:
        for key in ("seriesQuery", "metricsQuery"):
            u, errs = expr_metric_errors(r.get(key, ""), series, metrics)
            for e in errs:
                fail.add(f"rule {r.get('name', {}).get('as')} {key}: {e}")
            if not u:
                fail.add(f"rule {r.get('name', {}).get('as')} {key}: names no logprob metric")
        if not re.search(r"<<\.LabelMatchers>>", r.get("metricsQuery", "")):
            fail.add(f"rule {r.get('name', {}).get('as')}: metricsQuery lacks <<.LabelMatchers>>")
    ok &= fail.report()

    # Self-test: the metric checks reject a misspelt metric and a bare histogram name.
    probe = Failures("self-test")
    bad = copy.deepcopy(dash) if dash else {"panels": []}
    bad["panels"].append({"id": 999, "type": "timeseries", "title": "bad", "gridPos": {},
                          "targets": [{"refId": "A", "expr": "rate(logprob_request_total[5m])"},
                                      {"refId": "B", "expr": "logprob_queue_duration_seconds"},
                                      {"refId": "C", "expr": "up"}]})
    check_dashboard(bad, series, metrics, probe)
    if len(probe.errors) < 3:
        print(f"FAIL [self-test] broken dashboard queries not all rejected: {probe.errors}")
        ok = False

    promtool = shutil.which("promtool")
    if not promtool:
        log("SKIP: promtool not found (Debian: prometheus; scripts/install-deps.sh installs it)")
        return 1 if not ok else SKIP
    for args in (["check", "rules", os.path.join(mon, "alerts.yaml")],
                 ["test", "rules", os.path.join(root, "tests/deploy/alerts_test.yaml")]):
        r = subprocess.run([promtool] + args, capture_output=True, text=True)
        log(f"promtool {' '.join(args[:2])}: exit {r.returncode}\n{r.stdout.strip()}\n{r.stderr.strip()}")
        if r.returncode != 0:
            print(f"FAIL [promtool {' '.join(args[:2])}]")
            ok = False
    # Self-test: promtool rejects a broken rule file and a wrong expectation.
    with tempfile.TemporaryDirectory() as d:
        bad_rules = os.path.join(d, "bad.yaml")
        with open(bad_rules, "w") as f:
            f.write("groups:\n- name: x\n  rules:\n  - alert: A\n    expr: sum(rate(logprob_requests_total[5m]) > \n")
        if subprocess.run([promtool, "check", "rules", bad_rules], capture_output=True).returncode == 0:
            print("FAIL [self-test] promtool accepted a rule with a PromQL syntax error")
            ok = False
        with open(os.path.join(root, "tests/deploy/alerts_test.yaml")) as f:
            t = yaml.safe_load(f)
        t["rule_files"] = [os.path.join(mon, "alerts.yaml")]
        t["tests"][0]["alert_rule_test"][1]["exp_alerts"] = []  # LogprobHighErrorRate does fire there
        bad_test = os.path.join(d, "bad_test.yaml")
        with open(bad_test, "w") as f:
            yaml.safe_dump(t, f)
        if subprocess.run([promtool, "test", "rules", bad_test], capture_output=True).returncode == 0:
            print("FAIL [self-test] promtool test rules passed with a wrong expectation")
            ok = False
    return 0 if ok else 1


# ----------------------------------------------------------------------------- Dockerfile

def dockerfile_stages(text):
    """[(name, base, [instructions])] with continuation lines joined."""
    lines, cur = [], ""
    for raw in text.splitlines():
        s = raw.rstrip()
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if cur and s.lstrip().startswith("#"):
            continue
        cur += s[:-1] + " " if s.endswith("\\") else s
        if not s.endswith("\\"):
            lines.append(cur.strip())
            cur = ""
    stages = []
    for line in lines:
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.I)
        if m:
            stages.append((m.group(2) or f"stage{len(stages)}", m.group(1), []))
        elif stages:
            stages[-1][2].append(line)
    return stages


def check_dockerfile(text, fail):
    stages = dockerfile_stages(text)
    names = [s[0] for s in stages]
    for target in ("cpu", "gpu"):
        if target not in names:
            fail.add(f"no stage {target!r} (docker build --target {target})")
    if names and names[-1] != "cpu":
        fail.add(f"the last stage (docker build's default target) is {names[-1]!r}, not 'cpu'")
    by_name = {s[0]: s for s in stages}
    builders = set()
    for name, base, instr in stages:
        runs = " ".join(i for i in instr if i.upper().startswith("RUN"))
        if "scripts/build.sh" in runs:
            builders.add(name)
            a, b = runs.find("bash scripts/install-deps.sh"), runs.find("bash scripts/build.sh")
            if a < 0 or b < a:
                fail.add(f"stage {name}: does not run scripts/install-deps.sh then scripts/build.sh (the README's steps)")
    if not builders:
        fail.add("no stage runs scripts/build.sh")
    for target in ("cpu", "gpu"):
        if target not in by_name:
            continue
        _, base, instr = by_name[target]
        text_t = "\n".join(instr)
        if base in by_name:
            fail.add(f"stage {target}: should start from a slim base, not from build stage {base}")
        if "install-deps.sh" in text_t:
            fail.add(f"stage {target}: installs the -dev packages (install-deps.sh)")
        if "runtime-packages.txt" not in text_t:
            fail.add(f"stage {target}: does not install the runtime package list")
        users = [i.split(None, 1)[1] for i in instr if i.upper().startswith("USER ")]
        if not users:
            fail.add(f"stage {target}: no USER")
        else:
            uid = users[-1].split(":")[0]
            if not uid.isdigit() or uid == "0":
                fail.add(f"stage {target}: USER {users[-1]} is not a numeric non-root uid (runAsNonRoot needs one)")
        hc = [i for i in instr if i.upper().startswith("HEALTHCHECK")]
        if not hc or "logprob-client" not in hc[-1] or "health" not in hc[-1]:
            fail.add(f"stage {target}: no HEALTHCHECK with logprob-client health")
        ports = set()
        for i in instr:
            if i.upper().startswith("EXPOSE"):
                ports |= set(i.split()[1:])
        for p in ("50051", "9464", "50052"):
            if p not in ports:
                fail.add(f"stage {target}: port {p} not in EXPOSE")
        ep = [i for i in instr if i.upper().startswith("ENTRYPOINT")]
        if not ep or "logprob-server" not in ep[-1]:
            fail.add(f"stage {target}: ENTRYPOINT is not logprob-server")
        if not re.search(r"COPY\s+--from=(\S+)\s+/out/bin/\s", text_t):
            fail.add(f"stage {target}: does not copy the binaries (/out/bin/) from a build stage")
    if "gpu" in by_name:
        gpu_build = [s for s in stages if s[0] in builders and "cuda" in (s[1] + s[0])]
        if not gpu_build:
            fail.add("no CUDA build stage (a builder FROM a stage with the CUDA toolkit)")


def cmd_dockerfile(root, binaries):
    ok = True
    with open(os.path.join(root, "Dockerfile")) as f:
        text = f.read()
    fail = Failures("Dockerfile")
    check_dockerfile(text, fail)
    ok &= fail.report()
    # Self-test: a Dockerfile with gpu last, root user and no healthcheck is rejected.
    bad = text.replace("USER 10001:10001", "USER root").replace("HEALTHCHECK", "# HEALTHCHECK")
    probe = Failures("self-test")
    check_dockerfile(bad, probe)
    if len(probe.errors) < 2:
        print(f"FAIL [self-test] a root, healthcheck-less Dockerfile was accepted: {probe.errors}")
        ok = False
    log(f"{'ok' if ok else 'FAILED'}: Dockerfile stages " + ", ".join(s[0] for s in dockerfile_stages(text)))

    if not binaries:
        return 0 if ok else 1
    if not shutil.which("dpkg-query") or not shutil.which("ldd"):
        log("SKIP: runtime package list: dpkg-query or ldd missing (not Debian)")
        return 1 if not ok else SKIP
    missing = [b for b in binaries if not os.path.exists(b)]
    if missing:
        print(f"FAIL [runtime-packages] binaries not built: {missing}")
        return 1
    r = subprocess.run(["bash", os.path.join(root, "scripts/runtime-packages.sh")] + binaries,
                       capture_output=True, text=True)
    pkgs = r.stdout.split()
    log(f"runtime-packages.sh: exit {r.returncode}: {' '.join(pkgs)}\n{r.stderr.strip()}")
    if r.returncode != 0:
        print("FAIL [runtime-packages] scripts/runtime-packages.sh failed")
        ok = False
    if "libc6" not in pkgs:
        print("FAIL [runtime-packages] libc6 not listed")
        ok = False
    for p in pkgs:
        if not re.match(r"^[a-z0-9][a-z0-9+.-]+$", p):
            print(f"FAIL [runtime-packages] {p!r} is not a package name")
            ok = False
        if p.endswith("-dev"):
            print(f"FAIL [runtime-packages] a -dev package in the runtime list: {p}")
            ok = False
    for lib in ("libgrpc++", "libprotobuf", "libgloo", "libdnnl"):
        if not any(p.startswith(lib) for p in pkgs):
            print(f"FAIL [runtime-packages] no {lib}* package for the binaries")
            ok = False
    # Self-test: a binary linked to a library no package ships is refused.
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["bash", os.path.join(root, "scripts/runtime-packages.sh"), os.path.join(d, "missing")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            print("FAIL [self-test] runtime-packages.sh accepted a missing binary")
            ok = False
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=["manifests", "monitoring", "dockerfile"])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("--binaries", nargs="*", default=[])
    ap.add_argument("--server-binary", default="",
                    help="logprob-server, to check the front-end's memory limits against its bound")
    a = ap.parse_args()
    global SERVER_BINARY
    SERVER_BINARY = a.server_binary
    root = os.path.abspath(a.root)
    if a.check == "manifests":
        rc = cmd_manifests(root)
    elif a.check == "monitoring":
        rc = cmd_monitoring(root)
    else:
        rc = cmd_dockerfile(root, a.binaries)
    print({0: "PASSED", 1: "FAILED", SKIP: "SKIPPED"}[rc])
    return rc


if __name__ == "__main__":
    sys.exit(main())
