#!/bin/sh
# The torch requirement `make setup` installs first, with the pip options that pick the build
# for this machine. PyPI's Linux wheel of torch is a CUDA build (GBs of CUDA libraries): on a
# Linux machine without an NVIDIA driver, take the CPU build (torch==2.13.0+cpu) from torch's own
# CPU index, or, where that index is out of reach, from pip's configured sources (a wheelhouse,
# a mirror). With a driver (or TORCH_BUILD=default), PyPI's default build.
set -eu
version=2.13.0
if [ "$(uname -s)" != Linux ] || [ "${TORCH_BUILD:-}" = default ] \
   || { [ -z "${TORCH_BUILD:-}" ] && command -v nvidia-smi >/dev/null 2>&1; }; then
  echo "torch==$version"
  exit 0
fi
index=https://download.pytorch.org/whl/cpu
if python3 -c "import urllib.request as u; u.urlopen('$index/torch/', timeout=5)" 2>/dev/null; then
  echo "--extra-index-url $index torch==$version+cpu"
else
  echo "torch==$version+cpu"
fi
