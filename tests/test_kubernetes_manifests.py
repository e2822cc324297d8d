"""docs/kubernetes/*.yaml against the Kubernetes API's schemas, offline, with unknown fields refused as `kubectl
apply --validate=strict` refuses them: the built-in kinds with kubernetes-validate (which ships the schemas), the
InferencePool and HTTPRoute with the openAPIV3Schema of their CRDs, vendored in tests/k8s_schemas/ without the
descriptions: inference.networking.k8s.io_inferencepools.yaml of the Gateway API Inference Extension v1.5.0 and
gateway.networking.k8s.io_httproutes.yaml (standard channel) of Gateway API v1.4.0. The objects must also fit
each other: the pool selects the nanoserve pods, targets their OpenAI API, names the picker's Service, and the
nanoserve command is one `nanoserve serve` accepts."""
import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from nanoserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "docs" / "kubernetes").glob("*.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
               ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json"}
KUBERNETES_VERSION = "1.33.0"


def objects() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str) -> dict:
    return next(o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def strict(schema):
    """The CRD schema with unknown fields refused (the API server would prune them; kubectl's strict validation
    refuses them): every object schema with properties and no additionalProperties gets additionalProperties
    false. metadata is left open (ObjectMeta is the API server's, not the CRD's)."""
    schema = copy.deepcopy(schema)
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            pending += [v for k, v in node.items() if k != "metadata"]
        elif isinstance(node, list):
            pending += node
    return schema


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_each_object_fits_its_api_schema(obj):
    crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd_schema is None:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    else:
        schema = strict(json.loads((SCHEMAS / crd_schema).read_text()))
        jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)


def test_a_typo_is_caught_in_both_kinds_of_object():
    deployment = copy.deepcopy(find("Deployment", "nanoserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    pool = copy.deepcopy(find("InferencePool", "nanoserve"))
    pool["spec"]["targetPortNumber"] = 9000  # the v1alpha2 name
    with pytest.raises(jsonschema.ValidationError, match="targetPortNumber"):
        jsonschema.validate(pool, strict(json.loads((SCHEMAS / "inferencepool-v1.json").read_text())))


def test_the_pool_selects_the_nanoserve_pods_and_targets_their_openai_api():
    pod = find("Deployment", "nanoserve")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    pool = find("InferencePool", "nanoserve")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["targetPorts"]] == [ports["openai"]]
    picker = find("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    route = find("HTTPRoute", "nanoserve")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "nanoserve")


def test_probes_use_tritons_health_endpoints_and_the_command_is_nanoserve_serve():
    container = find("Deployment", "nanoserve")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    command = container["command"]
    assert command[:2] == ["nanoserve", "serve"]
    args = build_parser().parse_args(command[1:])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.http_port, args.grpc_port, args.metrics_port, args.openai_port) == (
        ports["http"], ports["grpc"], ports["metrics"], ports["openai"])
    assert args.host == "0.0.0.0" and args.report_custom_metrics  # the gauges the picker reads


def test_the_pickers_config_scores_by_vllm_gauges_and_scrapes_metrics():
    config = yaml.safe_load(find("ConfigMap", "nanoserve-epp")["data"]["default-plugins.yaml"])
    plugins = {plugin["type"]: plugin for plugin in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "core-metrics-extractor"} <= set(plugins)
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    referenced = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert referenced <= set(plugins)
