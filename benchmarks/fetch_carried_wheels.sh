#!/usr/bin/env bash
# Here, not on the device: fill .whl/ (git-ignored) with the wheels install_carried_wheels.sh installs on a GPU
# image that lacks them. The image runs CPython 3.12 on x86-64 Linux, so binary wheels are fetched for that
# platform, not this machine's; pure-Python ones are the same everywhere. The versions are the ones the committed
# records were measured with (kvpress 0.5.5, torchao 0.17.0, gguf 0.19.0, ...). DeepSpeed ships only a source
# archive: it is built here into a pure-Python wheel (its CUDA ops are compiled on first use, on the device).
# Idempotent: a wheel already in .whl/ is kept.
#   bash benchmarks/fetch_carried_wheels.sh          # all (~60 MiB with bitsandbytes)
#   NO_BNB=1 bash benchmarks/fetch_carried_wheels.sh # without bitsandbytes (41 MiB: a carry of its own)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .whl/deepspeed
pyver=${PY_VERSION:-3.12}
fetch() {  # dest spec...: binary wheels for the image's Python and platform
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp -d "$dest" "$@"
}
have() { compgen -G ".whl/$1" >/dev/null; }
have 'datasets-*.whl' || fetch .whl datasets==5.2.0
have 'dill-*.whl' || fetch .whl 'dill<0.4.1'
have 'multiprocess-*.whl' || fetch .whl 'multiprocess<0.70.19'
have 'xxhash-*.whl' || fetch .whl xxhash
have 'kvpress-*.whl' || fetch .whl kvpress==0.5.5
have 'cachetools-*.whl' || fetch .whl cachetools
have 'fire-*.whl' || fetch .whl fire
have 'termcolor-*.whl' || fetch .whl termcolor
have 'six-*.whl' || fetch .whl six
have 'optimum_quanto-*.whl' || fetch .whl optimum-quanto==0.2.7
have 'gguf-*.whl' || fetch .whl gguf==0.19.0
have 'torchao-*.whl' || fetch .whl torchao==0.17.0
have 'lomo_optim-*.whl' || fetch .whl lomo-optim==0.1.1
if [ "${NO_BNB:-0}" != 1 ]; then have 'bitsandbytes-*.whl' || fetch .whl bitsandbytes==0.50.2; fi
for dep in einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection; do
  have "deepspeed/${dep//-/_}-*.whl" || fetch .whl/deepspeed "$dep"
done
if ! have 'deepspeed/deepspeed-*.whl'; then
  # Pure Python: no op is prebuilt (DS_BUILD_OPS=0), so the build needs no CUDA here.
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl/deepspeed deepspeed==0.19.8
fi
du -sh .whl
ls .whl .whl/deepspeed
