"""Vendor a small extract of KubeRay's RayService CRD schema for test_kuberay.py.

    python tests/unit/data/extract_rayservice_schema.py ray.io_rayservices.yaml kuberay.yaml <kuberay-commit>

The input is ray-operator/config/crd/bases/ray.io_rayservices.yaml from github.com/ray-project/kuberay.
The extract keeps the CRD's types, required fields, enums and patterns along every path kuberay.yaml uses. Fields
it doesn't use stay as names accepting anything, so a misspelt field is still caught: objects get
additionalProperties: false, as kubectl's default strict field validation rejects unknown fields.
"""

import sys
from pathlib import Path

import yaml

KEYWORDS = ("type", "required", "enum", "format", "pattern", "anyOf", "minimum", "maximum")


def prune(schema: dict, instances: list) -> dict:
    out = {key: schema[key] for key in KEYWORDS if key in schema}
    if "properties" in schema:
        dicts = [i for i in instances if isinstance(i, dict)]
        out["properties"] = {
            name: prune(sub, [d[name] for d in dicts if name in d]) if any(name in d for d in dicts) else {}
            for name, sub in sorted(schema["properties"].items())}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(schema.get("additionalProperties"), dict):
        values = [v for i in instances if isinstance(i, dict) for v in i.values()]
        out["additionalProperties"] = prune(schema["additionalProperties"], values)
    if "items" in schema:
        out["items"] = prune(schema["items"], [x for i in instances if isinstance(i, list) for x in i])
    return out


def main(crd_path: str, manifest_path: str, commit: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    # kuberay.yaml holds more documents than the RayService (its NetworkPolicy).
    manifest = next(d for d in yaml.safe_load_all(Path(manifest_path).read_text())
                    if d and d.get("kind") == crd["spec"]["names"]["kind"])
    extract = {"apiVersion": f"{crd['spec']['group']}/{version['name']}", "kind": crd["spec"]["names"]["kind"],
               "schema": prune(version["schema"]["openAPIV3Schema"], [manifest])}
    header = (f"# Extract of the {extract['kind']} CRD's {version['name']} openAPIV3Schema, from\n"
              f"# https://github.com/ray-project/kuberay/blob/{commit}/ray-operator/config/crd/bases/"
              "ray.io_rayservices.yaml\n# Made by extract_rayservice_schema.py (see there); regenerate, don't edit.\n")
    out = Path(__file__).with_name("rayservice_crd_extract.yaml")
    out.write_text(header + yaml.safe_dump(extract, sort_keys=False, width=120))


if __name__ == "__main__":
    main(*sys.argv[1:])
