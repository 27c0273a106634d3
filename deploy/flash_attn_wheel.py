"""The URL of flash-attn's prebuilt wheel for the installed torch, CUDA and Python.

    python deploy/flash_attn_wheel.py 2.8.3   # prints the URL (the Docker build runs it)

flash-attn's setup.py (``get_wheel_url``) names its release wheels
``flash_attn-{version}+cu{cuda major}torch{torch major.minor}cxx11abi{TRUE|FALSE}-{cpXY}-{cpXY}-linux_x86_64.whl``
under ``https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/``.
Releases up to 2.8.3 map every CUDA >= 12 torch to a ``cu12`` wheel, which does not
load against a CUDA 13 torch; later setup.py versions add ``cu13``. So the wheel is
asked for the torch's own CUDA major, and a missing one is a missing wheel.
"""

import sys

RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"


def wheel_name(version: str, torch_version: str, cuda_version: str, cxx11_abi: bool, python: tuple[int, int]) -> str:
    """>>> wheel_name("2.8.3", "2.8.0+cu128", "12.8", True, (3, 12))
    'flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl'
    """
    torch_mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    py = f"cp{python[0]}{python[1]}"
    cuda = cuda_version.split(".")[0]
    return f"flash_attn-{version}+cu{cuda}torch{torch_mm}cxx11abi{str(cxx11_abi).upper()}-{py}-{py}-linux_x86_64.whl"


def wheel_url(version: str, name: str) -> str:
    return f"{RELEASES}/v{version}/{name}"


if __name__ == "__main__":
    import torch

    name = wheel_name(sys.argv[1], torch.__version__, torch.version.cuda or "none", torch._C._GLIBCXX_USE_CXX11_ABI,
                      sys.version_info[:2])
    print(wheel_url(sys.argv[1], name))
