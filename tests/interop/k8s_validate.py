"""Checks Kubernetes manifests against the Kubernetes API's own types.

The official Python client (`kubernetes`, pinned by scripts/python-env) is
generated from the API's OpenAPI schema: each type lists its fields
(`attribute_map`) and their types (`openapi_types`), and validates a whole
object (required fields, types, no unknown fields). Every document of every file named on the
command line is walked against the type its apiVersion and kind name: an
unknown field, a value of the wrong type or a missing required field is
reported with its path. Exit status 0 when all is well, 1 otherwise.

    python k8s_validate.py FILE.yaml...
    python k8s_validate.py --args FILE.yaml   # the inferd container's args, as JSON
"""

import json

import re
import sys

import yaml
from kubernetes import client

# The kinds the manifests use, by (apiVersion, kind).
KINDS = {
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
}


def check(value, type_name, path, errors):
    """Appends to `errors` what is wrong with `value` as a `type_name`."""
    if value is None:
        return
    inner = re.fullmatch(r"[lL]ist\[(.+)\]", type_name)
    if inner:
        if not isinstance(value, list):
            errors.append(f"{path}: a list expected, got {value!r}")
            return
        for i, item in enumerate(value):
            check(item, inner.group(1), f"{path}[{i}]", errors)
        return
    inner = re.fullmatch(r"dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\]", type_name)
    if inner:
        value_type = inner.group(2) or inner.group(4)
        if not isinstance(value, dict):
            errors.append(f"{path}: a map expected, got {value!r}")
            return
        for key, item in value.items():
            check(item, value_type, f"{path}.{key}", errors)
        return
    scalars = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
        "datetime": (str,),
        "date": (str,),
        "bytearray": (str,),
    }
    if type_name in scalars:
        ok = isinstance(value, scalars[type_name])
        if type_name in ("int", "float") and isinstance(value, bool):
            ok = False
        if not ok:
            errors.append(f"{path}: {type_name} expected, got {value!r}")
        return
    if type_name == "object":
        # Free-form (IntOrString, quantities, raw extensions).
        return
    model = getattr(client, type_name, None)
    if model is None:
        errors.append(f"{path}: unknown type {type_name}")
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: a {type_name} object expected, got {value!r}")
        return
    # Fields by their names on the wire only (the model also takes its
    # Python names, which the API server does not).
    fields = {wire: attr for attr, wire in model.attribute_map.items()}
    for key, item in value.items():
        attr = fields.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: {type_name} has no such field")
            continue
        check(item, model.openapi_types[attr], f"{path}.{key}", errors)


def main(paths):
    errors = []
    documents = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, doc in enumerate(yaml.safe_load_all(f)):
                if doc is None:
                    continue
                documents += 1
                where = f"{path}#{n}"
                kind = (doc.get("apiVersion"), doc.get("kind"))
                type_name = KINDS.get(kind)
                if type_name is None:
                    errors.append(f"{where}: no type known for {kind}")
                    continue
                check(doc, type_name, f"{where}({kind[1]})", errors)
                # The whole document through the generated model: required
                # fields, formats and enumerations.
                try:
                    getattr(client, type_name).model_validate(doc)
                except Exception as e:  # pydantic's ValidationError
                    for line in str(e).splitlines()[1:]:
                        if not line.startswith("    For further information"):
                            errors.append(f"{where}({kind[1]}): {line.strip()}")
    for e in errors:
        print(e)
    print(f"{documents} documents, {len(errors)} problems")
    return 1 if errors or documents == 0 else 0


def container_args(path):
    """The args of the container named inferd, in the file's workloads."""
    with open(path, encoding="utf-8") as f:
        for doc in yaml.safe_load_all(f):
            template = (doc or {}).get("spec", {}).get("template")
            if not template:
                continue
            for container in template["spec"]["containers"]:
                if container["name"] == "inferd":
                    print(json.dumps(container.get("args", [])))
                    return 0
    print(f"{path}: no container named inferd", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--args"]:
        sys.exit(container_args(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
