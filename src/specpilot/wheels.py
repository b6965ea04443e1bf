"""``specpilot wheels``: a folder of wheels that installs the workflow where no package registry is.

Cluster GPU nodes often reach no registry, and their images hold Python, torch and much else but not
Snakemake. This command writes, on a machine that reaches one, every wheel the workflow needs beyond
such an image, for a named Python and platform:

1. the dependency closure of Snakemake and of the serving packages (:data:`SERVING_PACKAGES`:
   ``specpilot serve`` and ``specpilot bench client``; ``pip wheel`` here: wheels from the index,
   pure-Python ones built from source distributions where the index has no wheel, e.g.
   ``connection_pool``);
2. each compiled wheel of it replaced by the one for the target (``pip download --no-deps
   --only-binary=:all: --python-version X.Y --implementation cp --platform ...``); pure-Python wheels
   (``py3-none-any``) serve every Python as they are;
3. specpilot itself as a wheel (from this checkout, without its dependencies);
4. the packages the image already has left out (``--exclude``, default :data:`IMAGE_PACKAGES`: what a
   GPU image with torch and transformers holds, checked on the H200 host), and the closure checked:
   every requirement of every wheel, its markers evaluated for the target, is in the folder or left out
   on purpose (:func:`closure_problems`);
5. optionally the benchmark data (``--data``: copied to ``DIR/data``), so that the folder is the one
   thing a machine without a registry needs besides the working tree.

Install on the target (as ``scripts/gpu_study.sh`` does; ``--target`` keeps the image's packages):
``python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl`` and run with
``PYTHONPATH=SITE`` and ``PATH=SITE/bin:$PATH``. With ``--exclude none`` the folder is complete for a
bare environment: ``pip install --no-index --find-links DIR snakemake``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from zipfile import ZipFile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from .errors import SpecpilotError

# What a GPU image with torch and transformers already holds (the H200 host, 2026-12-03:
# ../shared/notes/gpu-workflow.md) among the workflow's needs: left out of the folder by default.
IMAGE_PACKAGES = ("torch", "triton", "numpy", "pandas", "matplotlib", "transformers", "tokenizers", "safetensors",
                  "huggingface-hub", "tqdm", "regex", "filelock", "fsspec", "jinja2", "markupsafe", "pyyaml",
                  "requests", "urllib3", "idna", "certifi", "charset-normalizer", "psutil", "packaging",
                  "typing-extensions", "attrs", "wrapt", "tabulate")
MAX_MB = 60.0
# specpilot serve (FastAPI on uvicorn) and its benchmark client (openai): not in a GPU image either
SERVING_PACKAGES = ("fastapi", "uvicorn", "openai")


def add_arguments(p: argparse.ArgumentParser) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    p.add_argument("--out", required=True, help="folder to write the wheels to (created; its wheels replaced)")
    p.add_argument("--python", default=here, help=f"target Python X.Y (default this one's, {here})")
    p.add_argument("--platform", action="append", default=None,
                   help="target platform tag of the compiled wheels, e.g. manylinux2014_x86_64 (= glibc 2.17; "
                        "older manylinux tags are accepted with it); repeat for more. Default: this machine's "
                        "wheels, when --python is this Python")
    p.add_argument("--exclude", default=",".join(IMAGE_PACKAGES),
                   help="comma-separated packages the target already has, left out ('none': keep every one; "
                        "default: a GPU image with torch and transformers)")
    p.add_argument("--snakemake", default=None, help="Snakemake requirement (default: this environment's version)")
    p.add_argument("--project", default=None, help="the specpilot checkout to build (default: the one this runs from)")
    p.add_argument("--data", default=None, help="benchmark data folder to copy to OUT/data (optional)")
    p.add_argument("--max-mb", type=float, default=MAX_MB, help=f"refuse a folder larger than this (default {MAX_MB:g})")


def manylinux_tags(platform: str) -> list[str]:
    """``platform`` and the older manylinux tags a machine of it also runs (pip matches tags exactly):
    ``manylinux2014_x86_64`` -> manylinux_2_17 .. manylinux_2_5 and the legacy aliases; other
    platforms as given.

    Raises:
        SpecpilotError: a manylinux tag that does not parse."""
    legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
    alias = {v: k for k, v in legacy.items()}
    head, _, arch = platform.partition("_") if platform.split("_")[0] in legacy else ("", "", "")
    if head:
        glibc = legacy[head]
    elif platform.startswith("manylinux_2_"):
        try:
            glibc, arch = int(platform.split("_")[2]), "_".join(platform.split("_")[3:])
        except (IndexError, ValueError):
            raise SpecpilotError(f"--platform {platform!r}: not a manylinux_2_N_ARCH tag") from None
    else:
        return [platform]
    tags = []
    for n in range(glibc, 4, -1):
        tags.append(f"manylinux_2_{n}_{arch}")
        if n in alias:
            tags.append(f"{alias[n]}_{arch}")
    return tags


def target_environment(python: str, platform: str | None) -> dict:
    """The marker environment (PEP 508) of the target: this machine's, with the Python version and,
    for a Linux platform tag, sys_platform / platform_machine of the target."""
    env = dict(default_environment())
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython")
    if platform and "linux" in platform:
        arch = platform.split("_", 3)[-1] if platform.startswith("manylinux_") else platform.split("_", 1)[-1]
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=arch)
    return env


def _pip(args: list[str], what: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise SpecpilotError(f"{what} failed: pip {' '.join(args[:2])} ...: {tail}")


def is_pure(wheel: Path) -> bool:
    """A wheel every Python 3 and platform can install (``none`` ABI, ``any`` platform)."""
    _, _, _, tags = parse_wheel_filename(wheel.name)
    return any(t.abi == "none" and t.platform == "any" for t in tags)


def requirements(wheel: Path) -> list[Requirement]:
    """Requires-Dist of a wheel (its METADATA)."""
    with ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def closure_problems(wheels: list[Path], env: dict, excluded: set[str], skip: set[str] = frozenset()) -> list[str]:
    """Requirements no wheel of the folder meets: per wheel (but those named in ``skip``) every
    Requires-Dist whose marker holds for ``env`` (no extras) must be a package of the folder, in a
    version its specifier allows, or one of ``excluded`` (the target has it). One line per problem."""
    have = {}
    for w in wheels:
        name, ver, _, _ = parse_wheel_filename(w.name)
        have[canonicalize_name(name)] = ver
    out = []
    for w in wheels:
        name = canonicalize_name(parse_wheel_filename(w.name)[0])
        if name in skip:
            continue
        for req in requirements(w):
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep in excluded:
                continue
            if dep not in have:
                out.append(f"{w.name} needs {req}, which is neither in the folder nor left out as the target's")
            elif req.specifier and not req.specifier.contains(have[dep], prereleases=True):
                out.append(f"{w.name} needs {req}, the folder has {dep} {have[dep]}")
    return out


def _project(path: str | None) -> Path:
    root = Path(path) if path else Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise SpecpilotError(f"no specpilot checkout at {root} (no pyproject.toml): give --project")
    return root


def _snakemake_spec(spec: str | None) -> str:
    if spec:
        return spec
    try:
        return f"snakemake=={version('snakemake')}"
    except PackageNotFoundError:
        raise SpecpilotError("snakemake is not installed here: give --snakemake (e.g. snakemake==9.27.1)") from None


def serving_specs() -> list[str]:
    """Requirements of :data:`SERVING_PACKAGES`: this environment's versions (pinned), else the name."""
    out = []
    for name in SERVING_PACKAGES:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def _retarget(local: list[Path], python: str, platforms: list[str] | None, out: Path) -> list[Path]:
    """The wheels for the target: pure ones as they are; compiled ones kept when the target is this
    Python and platform, else downloaded for it (one pip call per package)."""
    kept = []
    for w in local:
        if is_pure(w) or platforms is None:
            kept.append(Path(shutil.copy2(w, out / w.name)))
            continue
        name, ver, _, _ = parse_wheel_filename(w.name)
        tags = [t for p in platforms for t in manylinux_tags(p)]
        before = set(out.glob("*.whl"))
        base = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
                *[a for t in dict.fromkeys(tags) for a in ("--platform", t)], "-d", str(out)]
        try:  # the version resolved here, else the newest one with a wheel for the target (the closure check
            _pip(base + [f"{name}=={ver}"], f"the {name} {ver} wheel")  # then tells whether its dependents allow it)
        except SpecpilotError:
            _pip(base + [str(name)], f"a {name} wheel for Python {python} on {', '.join(platforms)} (another "
                 f"--platform, e.g. manylinux_2_28_x86_64, if the target's glibc allows)")
        kept += sorted(set(out.glob("*.whl")) - before)
    return kept


def write_wheels(out: str | Path, python: str, platforms: list[str] | None, excluded: set[str],
                 snakemake: str | None = None, project: str | None = None, data: str | None = None,
                 max_mb: float = MAX_MB) -> dict:
    """Write the folder (see the module docstring); returns a summary (wheels, MB, left out, data).

    Raises:
        SpecpilotError: a pip step failed (its last lines named), the closure is incomplete (each
            missing requirement named), the folder is larger than ``max_mb``.
    """
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if platforms is None and python != here:
        raise SpecpilotError(f"--python {python} is not this Python ({here}): name the target's --platform")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    root = _project(project)
    with tempfile.TemporaryDirectory(prefix="specpilot-wheels-") as tmp:
        _pip(["wheel", "--wheel-dir", tmp, "--prefer-binary", _snakemake_spec(snakemake), *serving_specs()],
             "building the wheels of Snakemake and the serving packages")
        local = [w for w in Path(tmp).glob("*.whl") if canonicalize_name(parse_wheel_filename(w.name)[0]) not in excluded]
        wheels = _retarget(local, python, platforms, out)
        had_build = (root / "build").exists()
        try:
            _pip(["wheel", "--no-deps", "--wheel-dir", tmp + "/own", str(root)], "building the specpilot wheel")
        finally:  # setuptools builds in the source tree: leave the checkout as it was
            if not had_build:
                shutil.rmtree(root / "build", ignore_errors=True)
        own = [Path(shutil.copy2(w, out / w.name)) for w in Path(tmp, "own").glob("specpilot-*.whl")]
    env = target_environment(python, (platforms or [sysconfig.get_platform().replace("-", "_")])[0])
    problems = closure_problems(wheels + own, env, excluded, skip={"specpilot"})
    if problems:
        raise SpecpilotError("the wheel folder is incomplete: " + "; ".join(problems[:5]))
    if data:
        if not (Path(data) / "MANIFEST.json").is_file():
            raise SpecpilotError(f"--data {data}: no MANIFEST.json (a folder laid out like shared/data/benchmarks)")
        shutil.rmtree(out / "data", ignore_errors=True)
        shutil.copytree(data, out / "data")
    mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2 ** 20
    if mb > max_mb:
        raise SpecpilotError(f"the folder {out} holds {mb:.1f} MB, more than --max-mb {max_mb:g}: leave out what the "
                             f"target has (--exclude)")
    own_missing = sorted({canonicalize_name(r.name) for w in own for r in requirements(w) if r.marker is None}
                         - {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels} - excluded)
    return {"wheels": sorted(w.name for w in wheels + own), "mb": round(mb, 1), "excluded": sorted(excluded),
            "specpilot_requirements_not_included": own_missing, "data": str(out / "data") if data else None}


def run(args: argparse.Namespace) -> int:
    excluded = set() if args.exclude.strip().lower() in ("none", "") else \
        {canonicalize_name(x) for x in args.exclude.split(",") if x.strip()}
    s = write_wheels(args.out, args.python, args.platform, excluded, args.snakemake, args.project, args.data,
                     args.max_mb)
    target = f"Python {args.python}" + (f" on {', '.join(args.platform)}" if args.platform else " (this machine)")
    print(f"{len(s['wheels'])} wheels for {target}, {s['mb']} MB in {args.out}"
          + (f"; benchmark data in {s['data']}" if s["data"] else ""))
    if s["specpilot_requirements_not_included"]:
        print("not included (the target's image must have them, or the workflow does not import them there: "
              f"datasets only for Hub data): "
              f"{', '.join(s['specpilot_requirements_not_included'])}")
    print(f"install: python3 -m pip install --no-index --no-deps --target SITE {args.out}/*.whl; "
          f"then PYTHONPATH=SITE PATH=SITE/bin:$PATH")
    return 0
