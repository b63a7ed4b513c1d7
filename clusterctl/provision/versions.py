"""CUDA / cuDNN / NCCL version facts: minimum drivers, package names, and consistency checks. Pure."""

from __future__ import annotations

import re

__all__ = [
    "CUDA_MIN_DRIVER",
    "min_driver",
    "driver_ok",
    "parse_cuda",
    "cuda_apt_package",
    "cudnn_apt_packages",
    "nccl_apt_version",
    "cuda_pip_requirements",
    "cudnn_pip_requirement",
    "nccl_pip_requirement",
    "version_key",
]

# CUDA release -> the Linux x86_64 driver it ships with (CUDA release notes, "CUDA Toolkit and
# Corresponding Driver Versions", GA releases). A toolkit newer than the host's driver is refused.
CUDA_MIN_DRIVER: dict[str, str] = {
    "11.0": "450.36.06",
    "11.1": "455.23.05",
    "11.2": "460.27.03",
    "11.3": "465.19.01",
    "11.4": "470.42.01",
    "11.5": "495.29.05",
    "11.6": "510.39.01",
    "11.7": "515.43.04",
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

# cuDNN major -> CUDA majors it is built for.
_CUDNN_CUDA_MAJORS = {8: (10, 11, 12), 9: (11, 12, 13)}

_CUDA_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?\Z")
_CUDA_BUILD_RE = re.compile(r"\+cuda(\d+)\.(\d+)$")


def version_key(version: str) -> tuple[int, ...]:
    """Numeric sort key of a dotted version ('550.54.14' → (550, 54, 14)); non-digits are ignored."""
    return tuple(int(p) for p in re.findall(r"\d+", version))


def parse_cuda(version: str) -> tuple[int, int]:
    """(major, minor) of a CUDA version like '12.4' or '12.4.1'; ValueError when it is not one we know."""
    m = _CUDA_RE.match(version.strip())
    if not m:
        raise ValueError(f"CUDA version must look like 12.4 or 12.4.1, not {version!r}")
    key = f"{m.group(1)}.{m.group(2)}"
    if key not in CUDA_MIN_DRIVER:
        known = ", ".join(CUDA_MIN_DRIVER)
        raise ValueError(f"unknown CUDA release {key} (known: {known})")
    return int(m.group(1)), int(m.group(2))


def min_driver(cuda_version: str) -> str:
    """The minimum driver version for a CUDA toolkit version."""
    major, minor = parse_cuda(cuda_version)
    return CUDA_MIN_DRIVER[f"{major}.{minor}"]


def driver_ok(cuda_version: str, driver: str) -> bool:
    """True when `driver` (e.g. '535.104.05') can run CUDA `cuda_version`."""
    return version_key(driver) >= version_key(min_driver(cuda_version))


def _build_suffix_major(version: str, what: str, cuda_major: int) -> None:
    m = _CUDA_BUILD_RE.search(version)
    if m and int(m.group(1)) != cuda_major:
        raise ValueError(
            f"{what} {version} is built for CUDA {m.group(1)}.{m.group(2)}, "
            f"but cuda.version is {cuda_major}.x; use a +cuda{cuda_major}.N build"
        )


def cuda_apt_package(cuda_version: str) -> str:
    """NVIDIA's apt package for a toolkit: '12.4' → 'cuda-toolkit-12-4' (the name pins major.minor);
    '12.4.1' → 'cuda-toolkit-12-4=12.4.1-1' (NVIDIA's package version for that update)."""
    major, minor = parse_cuda(cuda_version)
    name = f"cuda-toolkit-{major}-{minor}"
    parts = cuda_version.strip().split(".")
    return f"{name}={cuda_version.strip()}-1" if len(parts) == 3 else name


def cudnn_apt_packages(cudnn_version: str, cuda_version: str) -> list[tuple[str, str]]:
    """(package, version) pairs for cuDNN from NVIDIA's apt repository, checked against the CUDA major.

    cuDNN 9: 'libcudnn9-cuda-12' / 'libcudnn9-dev-cuda-12' at e.g. '9.1.0.70-1'.
    cuDNN 8: 'libcudnn8' / 'libcudnn8-dev' at e.g. '8.9.7.29-1+cuda12.2'.
    """
    cuda_major, cuda_minor = parse_cuda(cuda_version)
    major = _cudnn_major(cudnn_version, cuda_major)
    _build_suffix_major(cudnn_version, "cudnn", cuda_major)
    version = cudnn_version if "-" in cudnn_version else f"{cudnn_version}-1"
    if major >= 9:
        return [(f"libcudnn{major}-cuda-{cuda_major}", version), (f"libcudnn{major}-dev-cuda-{cuda_major}", version)]
    if "+cuda" not in version:
        version = f"{version}+cuda{cuda_major}.{cuda_minor}"
    return [(f"libcudnn{major}", version), (f"libcudnn{major}-dev", version)]


def _cudnn_major(cudnn_version: str, cuda_major: int) -> int:
    m = re.fullmatch(r"(\d+)\.\d+(?:\.\d+)*(?:-\d+)?(?:\+cuda\d+\.\d+)?", cudnn_version)
    if not m:
        raise ValueError(f"cuDNN version must look like 9.1.0.70, not {cudnn_version!r}")
    major = int(m.group(1))
    if major not in _CUDNN_CUDA_MAJORS:
        raise ValueError(f"cuDNN {major}.x is not supported (supported: 8.x, 9.x)")
    if cuda_major not in _CUDNN_CUDA_MAJORS[major]:
        allowed = ", ".join(f"{c}.x" for c in _CUDNN_CUDA_MAJORS[major])
        raise ValueError(f"cuDNN {cudnn_version} has no build for CUDA {cuda_major}.x (it supports CUDA {allowed})")
    return major


def nccl_apt_version(nccl_version: str, cuda_version: str) -> str:
    """The libnccl2/libnccl-dev version: '2.21.5' with CUDA 12.4 → '2.21.5-1+cuda12.4'; checks the major."""
    cuda_major, cuda_minor = parse_cuda(cuda_version)
    if not re.fullmatch(r"2\.\d+\.\d+(?:-\d+)?(?:\+cuda\d+\.\d+)?", nccl_version):
        raise ValueError(f"NCCL version must look like 2.21.5 or 2.21.5-1+cuda12.4, not {nccl_version!r}")
    _build_suffix_major(nccl_version, "nccl", cuda_major)
    version = nccl_version if "-" in nccl_version else f"{nccl_version}-1"
    if "+cuda" not in version:
        version = f"{version}+cuda{cuda_major}.{cuda_minor}"
    return version


def _pip_version(version: str, what: str, cuda_major: int) -> str:
    _build_suffix_major(version, what, cuda_major)
    return re.sub(r"-\d+(\+cuda[\d.]+)?$", "", _CUDA_BUILD_RE.sub("", version))


def cuda_pip_requirements(cuda_version: str) -> list[str]:
    """pip requirements for the CUDA runtime wheels: '12.4' → ['nvidia-cuda-runtime-cu12==12.4.*'].

    From CUDA 13 NVIDIA publishes the runtime without the suffix ('13.0' → 'nvidia-cuda-runtime==13.0.*');
    `nvidia-cuda-runtime-cu13` is a 0.0.1 placeholder on PyPI."""
    major, minor = parse_cuda(cuda_version)
    name = "nvidia-cuda-runtime" if major >= 13 else f"nvidia-cuda-runtime-cu{major}"
    return [f"{name}=={major}.{minor}.*"]


def cudnn_pip_requirement(cudnn_version: str, cuda_version: str) -> str:
    """pip requirement for cuDNN: '9.1.0.70' with CUDA 12 → 'nvidia-cudnn-cu12==9.1.0.70'."""
    cuda_major, _ = parse_cuda(cuda_version)
    _cudnn_major(cudnn_version, cuda_major)
    return f"nvidia-cudnn-cu{cuda_major}=={_pip_version(cudnn_version, 'cudnn', cuda_major)}"


def nccl_pip_requirement(nccl_version: str, cuda_version: str) -> str:
    """pip requirement for NCCL: '2.21.5' with CUDA 12 → 'nvidia-nccl-cu12==2.21.5'."""
    cuda_major, _ = parse_cuda(cuda_version)
    nccl_apt_version(nccl_version, cuda_version)  # same format and major checks
    return f"nvidia-nccl-cu{cuda_major}=={_pip_version(nccl_version, 'nccl', cuda_major)}"
