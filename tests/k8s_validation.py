"""Offline validation of Kubernetes manifests for the tests: what an API server would reject, found without one.

``validate_manifest(obj)`` returns error strings (an empty list: valid), each ``Kind/name: field.path: message``.
``validate_documents(text)`` does the same for multi-document YAML such as the output of ``helm template``, naming
each document's ``# Source:`` file too. ``helm_binary()`` finds the helm that ``make setup`` installs.

- Built-in kinds are validated by ``kubernetes_validate`` in strict mode (an unknown field is an error) against the
  schemas of the newest Kubernetes it ships, or of ``version``. It reports only the first schema error of an object.
- Custom resources are validated against the CRDs in ``tests/data/crds``: KubeRay's own RayJob CRDs of the oldest and
  newest release the chart supports (``kuberay/v1.2.2``, ``kuberay/v1.7.0``; a RayJob is checked against each, and a
  finding of one release only names it), ServiceMonitor and PodMonitor (written for this project, see their headers),
  with every object closed unless the CRD says otherwise, so a misspelt field is an error. All their schema errors are
  reported, and what KubeRay's operator refuses beyond its schema (``tests/kuberay_rules.py``). The core objects a
  custom resource embeds (a RayJob's pod templates, head Service and autoscaler container) are then validated as their
  core kind, and its metadata as an ObjectMeta.
- A kind that neither knows is an error, never a silent pass.
- On top of the schemas, rules the API server enforces that the published schemas do not express: duplicate YAML keys;
  object names (DNS-1123 subdomain, or the stricter rule of Services, Namespaces, CronJobs, and of RayJobs, which
  KubeRay rejects unless they are DNS-1035 labels of at most 47 characters; RBAC names are paths);
  label keys and values; the values of common enumerated core fields (restartPolicy, also per workload kind,
  imagePullPolicy, protocols, tolerations, Service type, update strategies); resource quantities (syntax, not
  negative, requests within limits; extended resources such as nvidia.com/gpu whole, with limits, and requests equal
  to limits) and emptyDir size limits. Not covered: ResourceQuota and LimitRange quantities, cross-field rules of
  individual kinds (e.g. a Deployment's selector matching its template's labels).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import InvalidSchemaError, SchemaNotFoundError, latest_version

from rl.errors import UserError
from rl.launch import find_tool
from tests.kuberay_rules import kuberay_findings

CRD_DIR = Path(__file__).resolve().parent / "data" / "crds"

FieldPath = tuple[str | int, ...]
Finding = tuple[FieldPath, str]  # (field path, message)


# --- Tools ------------------------------------------------------------------------------------------------------------


def _tool(name: str) -> str | None:
    try:
        return find_tool(name)  # rl launch's own lookup: .venv/bin, where `make setup` installs it, then PATH
    except UserError:
        return None


def helm_binary() -> str | None:
    """The helm installed by ``make setup`` (next to this interpreter, i.e. .venv/bin/helm), else helm on PATH."""
    return _tool("helm")


def kubectl_binary() -> str | None:
    """The kubectl installed by ``make setup`` (.venv/bin/kubectl), else kubectl on PATH."""
    return _tool("kubectl")


# --- Entry points -----------------------------------------------------------------------------------------------------


def validate_manifest(obj: Any, version: str | None = None, *, source: str | None = None) -> list[str]:
    """Errors of one manifest (empty: valid), each naming the object (``Kind/name``) and the field path.

    ``version``: the Kubernetes version whose schemas apply to built-in kinds (default: the newest that
    kubernetes_validate ships; one it does not ship raises its VersionNotSupportedError). ``source``: where the
    manifest came from, added to each message.
    """
    version = version or latest_version()
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    kind = obj.get("kind") if isinstance(obj, dict) else None
    api_version = obj.get("apiVersion") if isinstance(obj, dict) else None
    label = f"{kind or '<no kind>'}/{meta.get('name') or meta.get('generateName') or '<no name>'}"
    label += f" ({source})" if source else ""
    if not isinstance(obj, dict):
        return [f"{label}: a manifest must be a mapping, not {type(obj).__name__}"]
    if not (isinstance(api_version, str) and api_version and isinstance(kind, str) and kind):
        return [f"{label}: apiVersion and kind must be non-empty strings"]

    findings: list[Finding] = []
    if (api_version, kind) in custom_resource_schemas():
        findings += _custom_resource_findings(obj, api_version, kind, version)
    else:
        findings += _core_findings(obj, version)
    findings += _name_findings(api_version, kind, obj.get("metadata"))
    findings += _label_findings(obj, ())
    findings += _quantity_findings(obj, ())
    return list(dict.fromkeys(f"{label}: {format_path(path)}: {message}" for path, message in findings))


def validate_documents(yaml_text: str, version: str | None = None) -> list[str]:
    """Errors of every manifest in a multi-document YAML text, e.g. ``helm template`` output; empty documents are
    skipped. A document's ``# Source: path`` comment (as helm writes it) is named in its messages, and YAML problems
    (including a duplicate key, which the API server rejects) by their line in ``yaml_text``."""
    errors: list[str] = []
    for first_line, chunk in _documents(yaml_text):
        found = _SOURCE_COMMENT.search(chunk)
        source = found.group(1).strip() if found else None
        where = f" ({source})" if source else ""
        try:
            documents = list(yaml.load_all(chunk, Loader=_StrictLoader))
        except yaml.MarkedYAMLError as e:
            mark = f" at line {first_line + e.problem_mark.line + 1} of the input" if e.problem_mark else ""
            try:  # name the object when the YAML can be read leniently (a duplicate key), and check it anyway
                documents = [d for d in yaml.safe_load_all(chunk) if d is not None]
            except yaml.YAMLError:
                documents = []
            first = documents[0] if documents and isinstance(documents[0], dict) else {}
            meta = first.get("metadata") if isinstance(first.get("metadata"), dict) else {}
            label = f"{first.get('kind', 'YAML')}{'/' + meta['name'] if meta.get('name') else ''}"
            errors.append(f"{label}{where}: {e.problem or e.context}{mark}")
        for document in documents:
            if document is not None:
                errors += validate_manifest(document, version, source=source)
    return errors


def _documents(text: str) -> Iterator[tuple[int, str]]:
    """The text between ``---`` separators, with the line number (from 0) where each starts."""
    start = line = 0
    for separator in _DOCUMENT_SEPARATOR.finditer(text):
        yield line, text[start:separator.start()]
        line += text.count("\n", start, separator.end())
        start = separator.end()
    yield line, text[start:]


def format_path(path: Iterable[str | int]) -> str:
    """``spec.template.spec.containers[0].name``; keys that are not plain names as ``["app.kubernetes.io/name"]``."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        elif isinstance(part, str) and _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(str(part))}]"
    return out or "<root>"


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_DOCUMENT_SEPARATOR = re.compile(r"^---[ \t]*(?:#.*)?$", re.MULTILINE)
_SOURCE_COMMENT = re.compile(r"^# Source: (.+)$", re.MULTILINE)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate mapping keys, as the API server's strict decoding does (PyYAML would keep
    the last value silently, hiding e.g. a template that writes ``resources:`` twice)."""


def _construct_mapping_once(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, str | int | float | bool):
            continue  # a complex key: not something a manifest has
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_once)


# --- Schema errors ----------------------------------------------------------------------------------------------------


def _describe(error: jsonschema.ValidationError) -> Iterator[Finding]:
    """Findings of one jsonschema error: unknown and missing fields are named in the path itself."""
    path = tuple(error.path)
    instance = error.instance
    if error.validator == "additionalProperties" and error.validator_value is False and isinstance(instance, dict):
        known = list((error.schema or {}).get("properties", {}))
        for key in instance:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                yield (*path, key), "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
    elif error.validator == "required" and isinstance(instance, dict):
        for key in error.validator_value:
            if key not in instance:
                yield (*path, key), "required field is missing"
    else:
        yield path, error.message


def _core_findings(obj: dict, version: str) -> list[Finding]:
    """Findings of a built-in kind: kubernetes_validate's (strict; it stops at the first error) and enum values."""
    findings = list(_enum_findings(obj))
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [*_describe(e), *findings]
    except SchemaNotFoundError:
        return [((), f"no schema for apiVersion {obj['apiVersion']!r} kind {obj['kind']!r}: not a built-in kind of "
                     f"Kubernetes {version} and not a custom resource in tests/data/crds")]
    except InvalidSchemaError as e:
        return [((), e.message)]
    return findings


# Enumerated values that the API server checks but kubernetes_validate's schemas do not carry (they have no enums).
_CONTAINER_ENUMS: dict[FieldPath, tuple[str, ...]] = {
    ("imagePullPolicy",): ("Always", "IfNotPresent", "Never"),
    ("terminationMessagePolicy",): ("File", "FallbackToLogsOnError"),
    ("ports", "*", "protocol"): ("TCP", "UDP", "SCTP"),
}
_POD_ENUMS: dict[FieldPath, tuple[str, ...]] = {
    ("restartPolicy",): ("Always", "OnFailure", "Never"),
    ("dnsPolicy",): ("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"),
    ("tolerations", "*", "operator"): ("Exists", "Equal"),
    ("tolerations", "*", "effect"): ("", "NoSchedule", "PreferNoSchedule", "NoExecute"),
    **{(containers, "*", *path): values for containers in ("containers", "initContainers", "ephemeralContainers")
       for path, values in _CONTAINER_ENUMS.items()},
}
_POD_SPEC_AT: dict[str, FieldPath] = {
    "Pod": ("spec",),
    "PodTemplate": ("template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    **{kind: ("spec", "template", "spec") for kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")},
}
_RESTART_POLICIES = {"Job": ("OnFailure", "Never"), "CronJob": ("OnFailure", "Never"),
                     **{kind: ("Always",) for kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet")}}
_KIND_ENUMS: dict[str, dict[FieldPath, tuple[str, ...]]] = {
    "Service": {("spec", "type"): ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"),
                ("spec", "ports", "*", "protocol"): ("TCP", "UDP", "SCTP"),
                ("spec", "externalTrafficPolicy"): ("Cluster", "Local"),
                ("spec", "internalTrafficPolicy"): ("Cluster", "Local"),
                ("spec", "sessionAffinity"): ("None", "ClientIP")},
    "Deployment": {("spec", "strategy", "type"): ("Recreate", "RollingUpdate")},
    "StatefulSet": {("spec", "podManagementPolicy"): ("OrderedReady", "Parallel"),
                    ("spec", "updateStrategy", "type"): ("RollingUpdate", "OnDelete")},
    "DaemonSet": {("spec", "updateStrategy", "type"): ("RollingUpdate", "OnDelete")},
    "Job": {("spec", "completionMode"): ("NonIndexed", "Indexed")},
    "CronJob": {("spec", "concurrencyPolicy"): ("Allow", "Forbid", "Replace")},
}


def _enum_findings(obj: dict) -> Iterator[Finding]:
    kind = obj.get("kind")
    if obj.get("apiVersion") not in ("v1", "apps/v1", "batch/v1"):
        return
    rules = dict(_KIND_ENUMS.get(kind, {}))
    pod_spec = _POD_SPEC_AT.get(kind)
    if pod_spec is not None:
        rules.update({(*pod_spec, *path): values for path, values in _POD_ENUMS.items()})
        if kind in _RESTART_POLICIES:
            rules[(*pod_spec, "restartPolicy")] = _RESTART_POLICIES[kind]
    for pattern, allowed in rules.items():
        for path, value in _find(obj, pattern):
            if isinstance(value, str) and value not in allowed:
                yield path, f"{value!r} is not one of {list(allowed)}"


# --- Custom resources -------------------------------------------------------------------------------------------------


@functools.cache
def custom_resource_schemas() -> dict[tuple[str, str], list[tuple[str | None, dict]]]:
    """(apiVersion, kind) -> [(release, JSON Schema)] of each custom resource version defined in tests/data/crds. A
    CRD in a folder of its own (``kuberay/v1.2.2``) is one release of its project, named after that folder; a kind
    defined by several releases is checked against each of them."""
    schemas: dict[tuple[str, str], list[tuple[str | None, dict]]] = {}
    for path in sorted(CRD_DIR.rglob("*.yaml")):
        release = None if path.parent == CRD_DIR else f"{path.parent.parent.name} {path.parent.name}"
        with path.open() as f:  # KubeRay's CRDs are over a megabyte: the C loader reads them in a second
            documents = list(yaml.load_all(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
        for crd in documents:
            if not crd:
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = _to_json_schema(version["schema"]["openAPIV3Schema"])
                schema.setdefault("properties", {})["metadata"] = {"type": "object"}  # checked as an ObjectMeta
                schemas.setdefault((f"{spec['group']}/{version['name']}", spec["names"]["kind"]), []).append(
                    (release, schema))
    return schemas


def _to_json_schema(node: Any) -> Any:
    """A CRD's OpenAPI v3 schema as JSON Schema. ``x-kubernetes-*`` keys are dropped, after ``int-or-string`` becomes
    integer-or-string and ``nullable`` allows null; an object without ``additionalProperties`` is closed unless it has
    ``x-kubernetes-preserve-unknown-fields`` (the API server prunes unknown fields, or with strict field validation
    rejects them: here they are errors)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "description", "default"):
            continue
        if key == "properties":
            out[key] = {name: _to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = _to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [_to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.get("type") == "object" and "additionalProperties" not in out:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
_FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)


@functools.cache
def _custom_resource_validators(api_version: str, kind: str) -> list[tuple[str | None, jsonschema.Validator]]:
    return [(release, jsonschema.Draft202012Validator(schema, format_checker=_FORMATS))
            for release, schema in custom_resource_schemas()[(api_version, kind)]]


# Core objects that custom resources embed, validated as that core kind: paths ("*": every item of a list) -> kind.
_EMBEDDED: dict[tuple[str, str], tuple[tuple[FieldPath, str], ...]] = {
    ("ray.io/v1", "RayJob"): (
        (("spec", "submitterPodTemplate"), "PodTemplateSpec"),
        (("spec", "rayClusterSpec", "headGroupSpec", "template"), "PodTemplateSpec"),
        (("spec", "rayClusterSpec", "workerGroupSpecs", "*", "template"), "PodTemplateSpec"),
        (("spec", "rayClusterSpec", "headGroupSpec", "headService"), "Service"),
        (("spec", "rayClusterSpec", "autoscalerOptions"), "Container"),
    ),
}
_AUTOSCALER_CONTAINER_FIELDS = ("image", "imagePullPolicy", "resources", "env", "envFrom", "volumeMounts",
                                "securityContext")


def _wrap(kind: str, value: dict) -> tuple[dict, FieldPath]:
    """A core object holding ``value``, for kubernetes_validate, and the path of ``value`` inside it."""
    meta = {"name": "embedded"}
    if kind == "PodTemplateSpec":
        return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": value}, ("template",)
    if kind == "Service":
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta, **value}, ()
    if kind == "Container":
        container = {"name": "autoscaler", **{k: v for k, v in value.items() if k in _AUTOSCALER_CONTAINER_FIELDS}}
        return ({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [container]}},
                ("spec", "containers", 0))
    if kind == "ObjectMeta":
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": value}, ("metadata",)
    raise ValueError(f"no core wrapper for {kind}")


def _find(node: Any, pattern: FieldPath, at: FieldPath = ()) -> Iterator[tuple[FieldPath, Any]]:
    if not pattern:
        yield at, node
    elif pattern[0] == "*":
        for i, item in enumerate(node if isinstance(node, list) else ()):
            yield from _find(item, pattern[1:], (*at, i))
    elif isinstance(node, dict) and pattern[0] in node:
        yield from _find(node[pattern[0]], pattern[1:], (*at, pattern[0]))


def _custom_resource_findings(obj: dict, api_version: str, kind: str, version: str) -> list[Finding]:
    validators = _custom_resource_validators(api_version, kind)
    per_release = [(release, [f for error in sorted(validator.iter_errors(obj), key=lambda e: format_path(e.path))
                              for f in _describe(error)]) for release, validator in validators]
    findings: list[Finding] = []
    for _, found in per_release:  # a finding of every release once; one of some releases names them
        for path, message in found:
            where = [r for r, other in per_release if (path, message) in other]
            tag = "" if len(where) == len(per_release) else f" (the {', '.join(map(str, where))} CRD)"
            if (path, message + tag) not in findings:
                findings.append((path, message + tag))
    findings += kuberay_findings(obj) if (api_version, kind) == ("ray.io/v1", "RayJob") else []
    embedded = [(("metadata",), "ObjectMeta"), *_EMBEDDED.get((api_version, kind), ())]
    for pattern, core_kind in embedded:
        for at, value in _find(obj, pattern):
            if not isinstance(value, dict):
                continue  # the CRD schema reports it
            wrapped, inner = _wrap(core_kind, value)
            for path, message in _core_findings(wrapped, version):
                findings.append(((*at, *path[len(inner):]) if path[:len(inner)] == inner else at, message))
    return findings


# --- Names and labels -------------------------------------------------------------------------------------------------

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_DNS1123_LABEL = re.compile(rf"^{_DNS_LABEL}$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_RBAC = "rbac.authorization.k8s.io/"


def _name_rule(api_version: str, kind: str) -> tuple[re.Pattern[str] | None, int, str]:
    """(pattern, maximum length, description) of the names the API server accepts for a kind."""
    if api_version.startswith(_RBAC):
        return None, 253, "a path segment (no '/' or '%', not '.' or '..')"
    if (api_version, kind) == ("v1", "Service"):
        return _DNS1035_LABEL, 63, "a DNS-1035 label (lower-case letters, digits, '-'; starts with a letter)"
    if (api_version, kind) == ("ray.io/v1", "RayJob"):  # KubeRay's own check: it names Services after the RayJob
        return _DNS1035_LABEL, 47, "a DNS-1035 label (lower-case letters, digits, '-'; starts with a letter)"
    if (api_version, kind) == ("v1", "Namespace"):
        return _DNS1123_LABEL, 63, "a DNS-1123 label (lower-case letters, digits, '-')"
    if kind == "CronJob":  # 52: room for the suffix of the Jobs it creates
        return _DNS1123_SUBDOMAIN, 52, "a DNS-1123 subdomain"
    return _DNS1123_SUBDOMAIN, 253, "a DNS-1123 subdomain (lower-case letters, digits, '-', '.')"


def _name_findings(api_version: str, kind: str, meta: Any) -> list[Finding]:
    if not isinstance(meta, dict):
        return [(("metadata",), "required field is missing")] if meta is None else []
    findings: list[Finding] = []
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        findings.append((("metadata", "name"), "required field is missing"))
    if isinstance(name, str) and name:
        pattern, limit, rule = _name_rule(api_version, kind)
        bad_segment = pattern is None and (name in (".", "..") or "/" in name or "%" in name)
        if len(name) > limit or bad_segment or (pattern is not None and not pattern.match(name)):
            findings.append((("metadata", "name"), f"{name!r} must be {rule}, at most {limit} characters"))
    namespace = meta.get("namespace")
    if isinstance(namespace, str) and namespace and not (len(namespace) <= 63 and _DNS1123_LABEL.match(namespace)):
        findings.append((("metadata", "namespace"), f"{namespace!r} must be a DNS-1123 label"))
    return findings


def _label_key_problem(key: Any) -> str | None:
    if not isinstance(key, str):
        return "a label or annotation key must be a string"
    prefix, _, name = key.rpartition("/")
    if prefix and not (len(prefix) <= 253 and _DNS1123_SUBDOMAIN.match(prefix)):
        return f"the prefix {prefix!r} must be a DNS-1123 subdomain"
    if not (len(name) <= 63 and _LABEL_NAME.match(name)):
        return f"the name {name!r} must be 1 to 63 of A-Z a-z 0-9 - _ . (alphanumeric at both ends)"
    return None


def _label_findings(node: Any, at: FieldPath) -> Iterator[Finding]:
    """Label keys and values of every ObjectMeta (``metadata.labels``) and label selector (``matchLabels``), and
    annotation keys."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _label_findings(item, (*at, i))
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        here = (*at, key)
        is_meta = key == "metadata" and isinstance(value, dict)
        maps = [(k, value.get(k)) for k in ("labels", "annotations")] if is_meta else []
        maps += [("matchLabels", value)] if key == "matchLabels" else []
        for kind, entries in maps:
            for entry, text in entries.items() if isinstance(entries, dict) else ():
                where = (*here, kind, entry) if is_meta else (*here, entry)
                problem = _label_key_problem(entry)
                if problem:
                    yield where, f"invalid key: {problem}"
                if kind != "annotations" and isinstance(text, str) and not (len(text) <= 63 and
                                                                             _LABEL_VALUE.match(text)):
                    yield where, f"label value {text!r} must be at most 63 of A-Z a-z 0-9 - _ . (alphanumeric ends)"
        yield from _label_findings(value, here)


# --- Quantities -------------------------------------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
           "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
           **{s: Decimal(2 ** (10 * (i + 1))) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}


def parse_quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity (``500m``, ``1.5Gi``, ``2``, ``1e3``) as a number; None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if len(suffix) > 1 and suffix[0] in "eE":
        return number.scaleb(int(suffix[1:]))
    return number * _SUFFIX[suffix]


def _extended_resource(name: str) -> bool:
    """A resource outside the kubernetes.io domain (e.g. nvidia.com/gpu): whole numbers, never overcommitted."""
    domain, slash, _ = name.partition("/")
    return bool(slash) and not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def _requirements_findings(requirements: dict, at: FieldPath) -> Iterator[Finding]:
    parsed: dict[tuple[str, str], Decimal] = {}
    for part in ("limits", "requests"):
        entries = requirements.get(part)
        for name, value in entries.items() if isinstance(entries, dict) else ():
            quantity = parse_quantity(value)
            if quantity is None:
                yield (*at, part, name), f"{value!r} is not a quantity (e.g. 500m, 2, 1.5Gi, 512Mi)"
            elif quantity < 0:
                yield (*at, part, name), f"{value!r} must not be negative"
            elif _extended_resource(str(name)) and quantity != quantity.to_integral_value():
                yield (*at, part, name), f"{value!r} must be a whole number (an extended resource)"
            else:
                parsed[part, str(name)] = quantity
    for (part, name), request in parsed.items():
        if part != "requests":
            continue
        limit = parsed.get(("limits", name))
        if _extended_resource(name) and limit is None:
            yield (*at, "limits", name), "required: an extended resource that is requested must have a limit"
        elif _extended_resource(name) and request != limit:
            yield (*at, "requests", name), f"must equal limits[{name!r}] (an extended resource is not overcommitted)"
        elif limit is not None and request > limit:
            yield (*at, "requests", name), f"must not exceed limits[{name!r}]"


def _quantity_findings(node: Any, at: FieldPath) -> Iterator[Finding]:
    """Quantities the schemas take as any string: ``resources`` limits and requests (containers, pods, volume claims)
    and ``emptyDir.sizeLimit``."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _quantity_findings(item, (*at, i))
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        here = (*at, key)
        if key == "resources" and isinstance(value, dict):
            yield from _requirements_findings(value, here)
        elif key == "emptyDir" and isinstance(value, dict) and "sizeLimit" in value:
            quantity = parse_quantity(value["sizeLimit"])
            if quantity is None or quantity < 0:
                yield (*here, "sizeLimit"), f"{value['sizeLimit']!r} is not a non-negative quantity"
        yield from _quantity_findings(value, here)
