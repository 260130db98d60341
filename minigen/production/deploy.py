"""Deployment files checked against the real schemas: Triton's model config and Kubernetes' API (chapter 15).

    parse_model_config(text)        -> Triton's ModelConfig protobuf; unknown fields, bad enums raise DeployError
    check_model_repository(folder)  -> {model name: ModelConfig} after Triton's layout rules
    load_manifests(path)            -> the Kubernetes objects of a YAML file, each checked key by key
    unknown_keys(data, klass)       -> the keys a Kubernetes API model does not know (the client ignores them)
    review_triton(config)           -> what is wrong or dated in a model config for serving an LLM
    review_hpa(hpa)                 -> what is wrong with an autoscaler's load signal for an LLM

The schemas are the ones that ship with the clients: `tritonclient`'s model_config_pb2 (the protobuf
Triton itself parses config.pbtxt with) and the `kubernetes` package's API models. Nothing here talks
to a server. The course's layer: the core never imports this module.
"""

from __future__ import annotations

import bisect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import kubernetes.client
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from ..errors import DeployError

ModelConfig = model_config_pb2.ModelConfig
# (apiVersion, kind) -> the client's model class: the kinds deploy/ uses.
KINDS = {("apps/v1", "Deployment"): "V1Deployment",
         ("v1", "Service"): "V1Service",
         ("v1", "ConfigMap"): "V1ConfigMap",
         ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler"}
# The only resources the resource-metrics API (metrics.k8s.io, served by metrics-server) reports.
RESOURCE_METRICS = ("cpu", "memory")
_API = kubernetes.client.ApiClient()


@dataclass(frozen=True)
class Finding:
    """One field of a deployment file that is wrong or dated, and why."""
    field: str  # the field's path, e.g. "platform" or "spec.metrics[0]"
    verdict: str  # "wrong" (does not do what it says) or "dated" (works, but not how LLMs are served now)
    why: str


# ---------------------------------------------------------------- Triton
def parse_model_config(text: str, source: str = "config.pbtxt") -> ModelConfig:
    """Parse config.pbtxt text strictly into Triton's ModelConfig: an unknown field or enum value raises."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as e:
        raise DeployError(f"{source} is not a valid Triton model config: {str(e).rstrip('.')}. Field names and enum "
                          "values are those of Triton's model_config.proto (tritonclient.grpc.model_config_pb2)") from None


def check_model_repository(folder: str | Path) -> dict[str, ModelConfig]:
    """Check a Triton model repository: <model>/config.pbtxt whose `name` is the folder's name, and
    at least one numeric version folder <model>/<n>/ that is not empty. Returns {name: config}."""
    folder = Path(folder)
    models = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if not models:
        raise DeployError(f"{folder} holds no model folder: a Triton model repository is <repo>/<model>/config.pbtxt "
                          "plus <repo>/<model>/<version>/")
    out = {}
    for model in models:
        path = model / "config.pbtxt"
        if not path.is_file():
            raise DeployError(f"{model} has no config.pbtxt: write one (Triton can auto-complete some backends' "
                              "configs, but this repository keeps every config explicit)")
        config = parse_model_config(path.read_text(encoding="utf-8"), source=str(path))
        if config.name and config.name != model.name:
            raise DeployError(f"{path}: name {config.name!r} differs from its folder {model.name!r}; Triton "
                              "refuses the model. Rename one of them")
        versions = [p for p in model.iterdir() if p.is_dir()]
        bad = [p.name for p in versions if not p.name.isdigit()]
        if bad or not versions:
            raise DeployError(f"{model}: version folders must be numbers (1/, 2/, ...); found "
                              f"{[p.name for p in versions] or 'none'}")
        empty = [p.name for p in versions if not any(p.iterdir())]
        if empty:
            raise DeployError(f"{model}: version folder(s) {empty} are empty: put the model file there "
                              "(model.json for the vLLM backend)")
        out[model.name] = config
    return out


def review_triton(config: ModelConfig) -> list[Finding]:
    """What is wrong or dated in `config` for serving an autoregressive LLM (chapter 15's criticism)."""
    found = []
    if config.platform in ("pytorch_libtorch", "onnxruntime_onnx", "tensorrt_plan") or config.backend in (
            "pytorch", "onnxruntime", "tensorrt"):
        found.append(Finding("platform" if config.platform else "backend", "dated",
                             f"{config.platform or config.backend} runs one forward pass per request: the "
                             "generation loop, the KV cache between steps and streaming are left to the client. "
                             "Serve LLMs with an engine backend: backend: \"vllm\" or \"tensorrtllm\""))
    if config.max_batch_size > 0 and not config.HasField("dynamic_batching"):
        found.append(Finding("max_batch_size", "wrong",
                             f"max_batch_size {config.max_batch_size} without dynamic_batching: Triton never "
                             "batches separate requests, it only accepts clients' own batches of up to that size. "
                             "An LLM engine batches per step itself (max_batch_size: 0 with the vLLM backend)"))
    ragged = [t.name for t in config.input if -1 in t.dims and not t.allow_ragged_batch]
    if config.max_batch_size > 0 and ragged:
        found.append(Finding("input", "wrong",
                             f"inputs {ragged} have variable length (-1) and no allow_ragged_batch: Triton's "
                             "batcher only joins requests of the same shape, so prompts of different lengths "
                             "never share a batch (or the client must pad them)"))
    for i, group in enumerate(config.instance_group):
        # model_config.proto, ModelInstanceGroup.count: "For a group assigned to GPU, the number of
        # instances created for each GPU listed in 'gpus'".
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and len(group.gpus) > 1 and group.count > 1:
            found.append(Finding(f"instance_group[{i}]", "wrong",
                                 f"count is per GPU listed: count {group.count} on gpus {list(group.gpus)} makes "
                                 f"{group.count * len(group.gpus)} instances, {group.count} copies of the weights "
                                 "on each GPU. One engine per GPU (count: 1), or KIND_MODEL and let the engine "
                                 "place itself (tensor parallel)"))
    if not config.model_transaction_policy.decoupled:
        found.append(Finding("model_transaction_policy", "dated",
                             "not decoupled: one response per request, so no token streams before the whole "
                             "answer is done (time to first token = end-to-end latency)"))
    return found


# ---------------------------------------------------------------- Kubernetes
def _type_of(type_name: str) -> tuple[str, str]:
    """'Optional[List[V1Container]]' -> ('list', 'V1Container'); 'Dict[str, str]' -> ('dict', 'str')."""
    while type_name.startswith("Optional["):
        type_name = type_name[len("Optional["):-1]
    m = re.fullmatch(r"List\[(.*)\]", type_name)
    if m:
        return "list", m.group(1)
    m = re.fullmatch(r"Dict\[[^,]*, (.*)\]", type_name)
    if m:
        return "dict", m.group(1)
    return "one", type_name


def unknown_keys(data, klass: str, path: str = "") -> list[str]:
    """The paths of every key in `data` that the Kubernetes API model `klass` (e.g. "V1Deployment") and
    its nested models do not define. The client's deserializer drops such keys without a word, so a
    misspelled `stabilizationWindowSecond` would silently fall back to the default."""
    kind, inner = _type_of(klass)
    if kind == "list":
        return [p for i, item in enumerate(data or []) for p in unknown_keys(item, inner, f"{path}[{i}]")]
    if kind == "dict":
        return [p for key, value in (data or {}).items() for p in unknown_keys(value, inner, f"{path}.{key}")]
    model = getattr(kubernetes.client.models, inner, None)
    if model is None or not isinstance(data, dict):  # a primitive, an int-or-string ('object'), a quantity
        return []
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    found = []
    for key, value in data.items():
        here = f"{path}.{key}" if path else key
        if key not in by_json:
            found.append(here)
        else:
            found += unknown_keys(value, model.openapi_types[by_json[key]], here)
    return found


def check_manifest(obj: dict, source: str = "manifest"):
    """One Kubernetes object (a dict from YAML) -> the client's model, after checking every key."""
    if not isinstance(obj, dict):
        raise DeployError(f"{source}: a manifest is a mapping with apiVersion and kind, got {type(obj).__name__}")
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in KINDS:
        known = ", ".join(f"{v} {k}" for v, k in KINDS)
        raise DeployError(f"{source}: apiVersion/kind {key[0]}/{key[1]} is not one deploy/ checks ({known}). "
                          "autoscaling/v2beta2 was removed in Kubernetes 1.26: use autoscaling/v2")
    stray = unknown_keys(obj, KINDS[key])
    if stray:
        raise DeployError(f"{source}: {key[1]} has keys the Kubernetes API does not define: {', '.join(stray)}. "
                          "Check their spelling against the API reference (kubectl explain)")
    try:
        return _API.deserialize(json.dumps(obj), KINDS[key], "application/json")
    except ValueError as e:  # pydantic's ValidationError is a ValueError: a missing or mistyped field
        first = str(e).strip().splitlines()
        raise DeployError(f"{source}: {key[1]} does not match the Kubernetes API: {' '.join(first[:3])}") from None


def load_manifests(path: str | Path) -> list:
    """Every object of a (multi-document) YAML manifest, each checked with check_manifest."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except yaml.YAMLError as e:
        raise DeployError(f"{path} is not valid YAML: {e}") from None
    if not docs:
        raise DeployError(f"{path} holds no Kubernetes object")
    return [check_manifest(d, source=f"{path.name} document {i + 1}") for i, d in enumerate(docs)]


def review_hpa(hpa) -> list[Finding]:
    """What is wrong with a V2HorizontalPodAutoscaler's load signal for an LLM server."""
    found = []
    metrics = hpa.spec.metrics or []
    for i, m in enumerate(metrics):
        if m.type == "Resource" and m.resource.name not in RESOURCE_METRICS:
            found.append(Finding(f"spec.metrics[{i}]", "wrong",
                                 f"Resource metric {m.resource.name!r}: the resource-metrics API (metrics-server) "
                                 f"reports only {' and '.join(RESOURCE_METRICS)}, so the HPA reads <unknown> and never "
                                 "scales. A GPU metric has to come through Pods or External metrics (DCGM exporter "
                                 "and a Prometheus adapter)"))
    gpu_only = metrics and all(_is_gpu_utilisation(m) for m in metrics)
    if gpu_only:
        found.append(Finding("spec.metrics", "wrong",
                             "GPU utilisation is the only signal: it is the fraction of time a kernel runs, which "
                             "reaches 100% with one request decoding and stays there at 64, so it cannot see the "
                             "queue. Scale on queued requests and KV-cache usage (vllm:num_requests_waiting, "
                             "vllm:kv_cache_usage_perc)"))
    return found


def _is_gpu_utilisation(metric) -> bool:
    name = (metric.resource.name if metric.type == "Resource" else
            metric.pods.metric.name if metric.type == "Pods" else
            metric.external.metric.name if metric.type == "External" else "")
    return "gpu" in name.lower() and "cache" not in name.lower()


def scale_down_steps(replicas: int, floor: int, percent: int) -> list[int]:
    """Replicas after each period of a Percent scale-down policy: Kubernetes' HPA controller allows
    int(replicas * (1 - percent / 100)) at the end of a period (horizontal.go rounds toward zero)."""
    steps = [replicas]
    while steps[-1] > floor:
        steps.append(max(floor, int(steps[-1] * (1 - percent / 100))))
    return steps


# ---------------------------------------------------------------- what utilisation sees
@dataclass(frozen=True)
class ServerRun:
    """A simulated LLM server under one load: what a utilisation gauge and a queue gauge would read."""
    load: float  # offered tokens/s over the server's batched capacity
    busy_fraction: float  # fraction of time a step runs: what "GPU utilisation" measures
    mean_waiting: float  # requests queued, averaged over time: vllm:num_requests_waiting
    mean_batch: float  # sequences per step while busy: vllm:num_requests_running
    finished: int  # requests completed within the horizon


def simulate_server(step_s: list[float], load: float, new_tokens: int = 64, lifetimes: float = 100.0,
                    seed: int = 0) -> ServerRun:
    """Continuous batching of Poisson arrivals on one server whose decode step takes step_s[b - 1]
    seconds at batch b (b up to len(step_s)); each request decodes `new_tokens` tokens (prefill left
    out). `load` scales the arrival rate to the capacity, max batch / step_s[-1] tokens/s. The run
    lasts `lifetimes` times a request's decode at full batch, so its shape does not depend on the
    step times' scale, only on their ratios."""
    max_batch = len(step_s)
    horizon_s = lifetimes * new_tokens * step_s[-1]
    rate = load * max_batch / step_s[-1] / new_tokens  # requests per second
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < horizon_s:
        t += rng.expovariate(rate)
        arrivals.append(t)
    now, busy, waiting_area, batch_area, finished, nxt = 0.0, 0.0, 0.0, 0.0, 0, 0
    running: list[int] = []  # tokens left per running request
    while now < horizon_s:
        while nxt < len(arrivals) and arrivals[nxt] <= now and len(running) < max_batch:
            running.append(new_tokens)  # admitted: first come, first served
            nxt += 1
        if not running:  # idle until the next arrival
            now = arrivals[nxt] if nxt < len(arrivals) else horizon_s
            continue
        queued = bisect.bisect_right(arrivals, now) - nxt  # arrived, not admitted
        step = step_s[len(running) - 1]
        busy, waiting_area, batch_area = busy + step, waiting_area + queued * step, batch_area + len(running) * step
        running = [left - 1 for left in running]
        finished += sum(1 for left in running if left == 0)
        running = [left for left in running if left > 0]
        now += step
    return ServerRun(load, busy / now, waiting_area / now, batch_area / max(busy, 1e-12), finished)
