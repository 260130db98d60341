"""deploy/ against the real schemas (chapter 15): every config.pbtxt parses strictly into Triton's
ModelConfig protobuf (tritonclient), the model repository follows Triton's layout rules, every
Kubernetes manifest matches the kubernetes client's API models key by key, the article's config and
policy are criticised field by field, and the settings map cannot drift from GenerationConfig."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import kubernetes.client
import pytest
import yaml

import minigen
from minigen.__main__ import build_parser
from minigen.serving.async_engine import AsyncEngine
from minigen.serving.engine import Engine
from minigen.serving.server import ServerMetrics, make_app
from minigen.production import deploy, engines as production
from minigen.config import GenerationConfig
from minigen.errors import ConfigError, DeployError

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
REPOSITORY = DEPLOY / "triton" / "model_repository"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
SERVE_MANIFESTS = sorted((DEPLOY / "minigen").glob("*.yaml"))  # minigen serve's own pod, Service and HPA


# ---------------------------------------------------------------- Triton: the schema and the layout
@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("config.pbtxt")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_config_pbtxt_parses_into_tritons_model_config(path):
    config = deploy.parse_model_config(path.read_text(encoding="utf-8"), source=str(path))
    assert isinstance(config, deploy.model_config_pb2.ModelConfig) and config.name


@pytest.mark.parametrize("broken, fragment", [
    ('name: "m"\nbackend: "vllm"\nmax_batch_sise: 0\n', 'no field named "max_batch_sise"'),  # misspelled field
    ('name: "m"\ninstance_group [{ kind: KIND_GPUS }]\n', "no value named KIND_GPUS"),  # bad enum value
    ('name: "m"\ninput [{ name: "x" data_type: TYPE_INT33 dims: [1] }]\n', "TYPE_INT33"),
    ('name: "m"\nmax_batch_size: "8"\n', "Couldn't parse integer"),  # wrong type
])
def test_unknown_fields_and_bad_enum_values_fail(broken, fragment):
    with pytest.raises(DeployError) as e:
        deploy.parse_model_config(broken)
    assert fragment in str(e.value) and e.value.__cause__ is None


def test_the_model_repository_follows_tritons_layout():
    configs = deploy.check_model_repository(REPOSITORY)
    assert set(configs) == {"smollm2"}
    config = configs["smollm2"]
    assert config.backend == "vllm" and config.max_batch_size == 0 and config.model_transaction_policy.decoupled
    assert deploy.review_triton(config) == []  # none of the article's problems
    assert config.parameters["REPORT_CUSTOM_METRICS"].string_value == "true"  # the autoscaler's metrics


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: (m / "config.pbtxt").write_text('name: "other"\nbackend: "vllm"\n'), "differs from its folder"),
    (lambda m: (m / "1").rename(m / "v1"), "must be numbers"),
    (lambda m: shutil.rmtree(m / "1"), "must be numbers"),
    (lambda m: (m / "1" / "model.json").unlink(), "are empty"),
    (lambda m: (m / "config.pbtxt").unlink(), "has no config.pbtxt"),
])
def test_layout_rules_catch_a_broken_repository(tmp_path, damage, fragment):
    repo = tmp_path / "repo"
    shutil.copytree(REPOSITORY, repo)
    damage(repo / "smollm2")
    with pytest.raises(DeployError, match=fragment):
        deploy.check_model_repository(repo)


def test_model_json_is_the_minigen_config_as_vllm_engine_args():
    """1/model.json (vLLM's engine arguments) = the map applied to deploy/triton/minigen_config.json,
    plus what only a deployment sets. enforce_eager is False: minigen's cuda_graphs=True, which a
    machine without CUDA refuses to build."""
    engine_args = json.loads((REPOSITORY / "smollm2" / "1" / "model.json").read_text())
    config = GenerationConfig.from_json(DEPLOY / "triton" / "minigen_config.json")
    mapped = production.vllm_engine_args(config, max_batch_size=64) | {"enforce_eager": False}
    deployment_only = {"model", "enable_prefix_caching", "max_num_batched_tokens", "max_model_len",
                       "gpu_memory_utilization", "disable_log_stats"}
    assert {k: v for k, v in engine_args.items() if k not in deployment_only} == mapped
    # every key is an engine argument the map names (as a flag) or one deployment_only lists
    flags = {s.args["vllm"].removeprefix("--").replace("-", "_") for s in production.SETTINGS}
    assert set(engine_args) <= flags | deployment_only | {"enforce_eager", "kv_cache_dtype"}


# ---------------------------------------------------------------- Kubernetes: every key checked
@pytest.mark.parametrize("path", MANIFESTS + SERVE_MANIFESTS + [DEPLOY / "article" / "hpa.yaml"],
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_matches_the_kubernetes_api_models(path):
    objects = deploy.load_manifests(path)
    assert objects and all(type(o).__name__ in deploy.KINDS.values() for o in objects)


def test_the_deserializer_alone_ignores_a_misspelled_key_and_unknown_keys_catches_it():
    hpa = yaml.safe_load((DEPLOY / "k8s" / "hpa.yaml").read_text())
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSecond"] = \
        hpa["spec"]["behavior"]["scaleDown"].pop("stabilizationWindowSeconds")
    # the client drops the key without a word: the window silently becomes the default (None)
    quiet = kubernetes.client.ApiClient().deserialize(json.dumps(hpa), "V2HorizontalPodAutoscaler", "application/json")
    assert quiet.spec.behavior.scale_down.stabilization_window_seconds is None
    assert deploy.unknown_keys(hpa, "V2HorizontalPodAutoscaler") == ["spec.behavior.scaleDown.stabilizationWindowSecond"]
    with pytest.raises(DeployError, match="stabilizationWindowSecond"):
        deploy.check_manifest(hpa)


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"),
     "spec.template.spec.containers[0].imagePullPolicyy"),  # deep inside a list
    (lambda d: d["metadata"].update(lables={"a": "b"}), "metadata.lables"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"].update(limit={"cpu": "1"}), "resources.limit"),
    (lambda d: d.update(apiVersion="apps/v1beta1"), "is not one deploy/ checks"),
    (lambda d: d["spec"].update(replicas="two"), "does not match the Kubernetes API"),  # a mistyped value
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "does not match the Kubernetes API"),
])
def test_a_broken_deployment_is_refused_with_the_key(edit, fragment):
    data = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    edit(data)
    with pytest.raises(DeployError, match=fragment.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        deploy.check_manifest(data)


def test_the_hpa_scales_on_llm_load_not_gpu_utilisation():
    hpa, = deploy.load_manifests(DEPLOY / "k8s" / "hpa.yaml")
    names = {m.pods.metric.name for m in hpa.spec.metrics if m.type == "Pods"}
    assert names == {"vllm_num_requests_waiting", "vllm_kv_cache_usage_perc"}
    assert deploy.review_hpa(hpa) == []
    rules = yaml.safe_load(deploy.load_manifests(DEPLOY / "k8s" / "prometheus-adapter.yaml")[0].data["config.yaml"])
    assert {r["name"]["as"] for r in rules["rules"]} == names  # the adapter serves exactly those names
    deployment, = deploy.load_manifests(DEPLOY / "k8s" / "deployment.yaml")
    assert hpa.spec.scale_target_ref.name == deployment.metadata.name
    service, = deploy.load_manifests(DEPLOY / "k8s" / "service.yaml")
    assert service.spec.selector == deployment.spec.template.metadata.labels
    assert 8002 in {p.port for p in service.spec.ports}  # Triton's metrics port, where vLLM's gauges are


# ---------------------------------------------------------------- the article's files, criticised
def test_the_articles_triton_config_is_valid_but_wrong_or_dated_in_five_fields():
    config = deploy.parse_model_config((DEPLOY / "article" / "config.pbtxt").read_text())
    assert config.platform == "pytorch_libtorch" and config.max_batch_size == 8  # as the article describes it
    found = {f.field: f.verdict for f in deploy.review_triton(config)}
    assert found == {"platform": "dated", "max_batch_size": "wrong", "input": "wrong",
                     "instance_group[0]": "wrong", "model_transaction_policy": "dated"}
    group = config.instance_group[0]
    assert group.count * len(group.gpus) == 4  # "two instances on GPUs 0 and 1" is four instances


def test_the_articles_hpa_is_valid_yet_never_scales():
    hpa, = deploy.load_manifests(DEPLOY / "article" / "hpa.yaml")
    assert hpa.spec.metrics[0].resource.target.average_utilization == 70  # as the article describes it
    assert hpa.spec.behavior.scale_down.stabilization_window_seconds == 300
    found = {f.field: f.verdict for f in deploy.review_hpa(hpa)}
    assert found == {"spec.metrics[0]": "wrong", "spec.metrics": "wrong"}
    # Its scale-down policy (10% a minute, rounded toward zero as the HPA controller does) is kept.
    assert deploy.scale_down_steps(10, 1, 10) == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert deploy.scale_down_steps(40, 1, 10)[:3] == [40, 36, 32]


# ---------------------------------------------------------------- the settings map
def test_every_minigen_name_in_the_map_exists():
    fields = set(GenerationConfig.field_names())
    named = [n for s in production.SETTINGS for n in s.minigen]
    assert named and set(named) <= fields, sorted(set(named) - fields)
    assert len(named) == len(set(named))  # each field in one concept
    assert fields <= set(named), f"fields the map does not place: {sorted(fields - set(named))}"
    engine_args = {n for s in production.SETTINGS for n in s.engine} - {"Engine"}
    assert engine_args == {"max_batch_size", "num_blocks", "max_num_batched_tokens"}
    assert engine_args <= set(inspect.signature(minigen.Engine).parameters)  # chapter 14's engine


def test_a_misspelled_field_in_the_map_would_be_caught(tmp_path):
    text = production.MAP_PATH.read_text().replace('minigen = ["kv_dtype"]', 'minigen = ["kv_dtpye"]')
    (tmp_path / "map.toml").write_text(text)
    named = {n for s in production.load_settings(tmp_path / "map.toml") for n in s.minigen}
    assert "kv_dtpye" in named and "kv_dtpye" not in GenerationConfig.field_names()


def test_every_setting_cites_known_sources_and_names_each_engine():
    for s in production.SETTINGS:
        assert s.sources and set(s.sources) <= set(production.SOURCES), s.concept
        for engine in production.ENGINES:
            assert s.args[engine] or s.notes[engine], f"{s.concept}: say why {engine} has no argument"
    vllm = {s.args["vllm"] for s in production.SETTINGS}
    assert {"--block-size", "--kv-cache-dtype", "--enable-prefix-caching", "--max-num-seqs",
            "--max-num-batched-tokens", "--kv-offloading-size", "--enforce-eager", "--scheduling-policy"} <= vllm
    table = production.settings_table()
    assert table.count("\n") == len(production.SETTINGS) + 1 and "`--block-size`" in table


def test_vllm_engine_args_map_each_setting():
    args = production.vllm_engine_args(GenerationConfig(cache_chunk_size=32, kv_dtype="float16"),
                                       max_batch_size=16, num_blocks=100)
    assert args == {"block_size": 32, "kv_cache_dtype": "float16", "enforce_eager": True, "max_num_seqs": 16,
                    "num_gpu_blocks_override": 100}
    assert production.vllm_engine_args(GenerationConfig(kv_dtype="float32")) == {
        "dtype": "float32", "kv_cache_dtype": "auto", "enforce_eager": True}
    compiled = production.vllm_engine_args(GenerationConfig(compile=True))
    assert compiled["compilation_config"] == {"cudagraph_mode": "NONE"} and compiled["enforce_eager"] is False
    assert production.vllm_engine_args(GenerationConfig(fused_decode=True)) == {  # vLLM's step is fused its own way
        "kv_cache_dtype": "auto", "enforce_eager": False}
    assert production.vllm_cli(args) == ["--block-size", "32", "--kv-cache-dtype", "float16", "--enforce-eager",
                                         "--max-num-seqs", "16", "--num-gpu-blocks-override", "100"]
    assert production.sampling_params(GenerationConfig(do_sample=True, temperature=0.7, top_k=50, seed=1,
                                                       stop_token_ids=[2])) == {
        "max_tokens": 32, "temperature": 0.7, "top_k": 50, "seed": 1, "stop_token_ids": [2]}


def test_the_articles_generation_config_is_refused_with_every_key_named():
    article = GenerationConfig(cache_chunk_size=256, quant_bits=4, window_size=128, sparsity_threshold=0.1,
                               prefetch_depth=2)
    with pytest.raises(ConfigError) as e:
        production.vllm_engine_args(article)
    for key in ("quant_bits", "window_size", "sparsity_threshold", "prefetch_depth"):
        assert key in str(e.value)
    assert "cache_chunk_size" not in str(e.value).split("(")[0]  # the block size maps
    with pytest.raises(ConfigError, match="max_batch_size=0"):
        production.vllm_engine_args(GenerationConfig(), max_batch_size=0)


def test_refusals_cover_every_field_with_no_vllm_argument():
    """A field whose concept has no vLLM argument must be refused (or be a switch for one that is)."""
    silent = []
    for s in production.SETTINGS:
        if not s.args["vllm"] and s.concept != "attention kernel":
            silent += [n for n in s.minigen if n not in production.NO_VLLM_EQUIVALENT]
    # sparse_score only chooses how the (refused) sparse keys are ranked
    assert silent == ["sparse_score"], silent
    assert set(production.NO_VLLM_EQUIVALENT) <= {f.name for f in dataclasses.fields(GenerationConfig)}


# (chapter 15's exercise is tested in test_exercise_ch15.py)


# ---------------------------------------------------------------- utilisation against the queue
def test_busy_fraction_saturates_while_the_queue_grows():
    step_s = [0.02 + 0.03 * (b - 1) / 7 for b in range(1, 9)]  # batch 8 costs 2.5x batch 1
    runs = {load: deploy.simulate_server(step_s, load, lifetimes=50, seed=0) for load in (0.1, 0.9, 1.5)}
    assert runs[0.1].busy_fraction < 0.5 and runs[0.1].mean_waiting == 0
    assert runs[1.5].busy_fraction - runs[0.9].busy_fraction < 0.05 and runs[1.5].busy_fraction > 0.99
    assert runs[1.5].mean_waiting > 20 * runs[0.9].mean_waiting
    assert 7.5 < runs[1.5].mean_batch <= 8  # overloaded: every step runs a full batch
    assert deploy.simulate_server(step_s, 0.9, lifetimes=50, seed=0) == runs[0.9]  # seeded
    # scale-free: the same ratios of step times give the same run
    slower = deploy.simulate_server([10 * s for s in step_s], 0.9, lifetimes=50, seed=0)
    assert abs(slower.busy_fraction - runs[0.9].busy_fraction) < 1e-9 and slower.finished == runs[0.9].finished


def test_no_deploy_file_reads_vllms_deprecated_cache_gauge():
    """vLLM renamed vllm:gpu_cache_usage_perc to vllm:kv_cache_usage_perc (PR 18354) and stopped emitting the
    old name by default (PR 29330): an HPA on it would read nothing (issue 26)."""
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".pbtxt", ".json"}:
            assert "gpu_cache_usage_perc" not in path.read_text(), path


def test_minigen_serves_manifests_point_at_what_the_server_has(tiny_llama):
    """deploy/minigen runs `python -m minigen serve` in a pod: its arguments parse with minigen's own
    command line (binding 0.0.0.0, since a pod is reached on its IP), every probe's path is a route of
    the app, the Service selects the pod, and each series the HPA scales on (through the adapter's
    rules) is a metric the server registers. Chapter 15 checks the same against a running server."""
    deployment, = deploy.load_manifests(DEPLOY / "minigen" / "deployment.yaml")
    service, = deploy.load_manifests(DEPLOY / "minigen" / "service.yaml")
    hpa, = deploy.load_manifests(DEPLOY / "minigen" / "hpa.yaml")
    container = deployment.spec.template.spec.containers[0]
    assert container.args[:4] == ["python", "-m", "minigen", "serve"]
    args = build_parser().parse_args(container.args[3:])
    assert args.func.__name__ == "cmd_serve" and args.host == "0.0.0.0"
    assert {p.container_port for p in container.ports} == {args.port}
    assert deployment.spec.template.spec.termination_grace_period_seconds > args.grace_s  # SIGTERM's drain fits
    engine = AsyncEngine(Engine(tiny_llama[1], max_batch_size=2, num_blocks=16))
    app = make_app(engine, None, "tiny", max_context=128)
    routes = {r.path for r in app.routes}
    for kind in ("readiness", "liveness", "startup"):
        assert getattr(container, f"{kind}_probe").http_get.path in routes
    assert service.spec.selector == deployment.spec.template.metadata.labels
    assert hpa.spec.scale_target_ref.name == deployment.metadata.name and deploy.review_hpa(hpa) == []
    adapter = yaml.safe_load(deploy.load_manifests(DEPLOY / "k8s" / "prometheus-adapter.yaml")[0].data["config.yaml"])
    series_of = {r["name"]["as"]: r["seriesQuery"].split("{")[0].strip("'") for r in adapter["rules"]}
    registered = {m.name for m in ServerMetrics(engine, "tiny").registry.collect()}
    assert {series_of[m.pods.metric.name] for m in hpa.spec.metrics} <= registered
