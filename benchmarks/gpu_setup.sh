# Sourced at the start of every GPU-machine call (see benchmarks/README.md).
# AOTInductor must link with the system compiler there (DEVICE.md: /opt/gcc's static libstdc++ segfaults at load).
export CXX=/usr/bin/g++ CC=/usr/bin/gcc PYTHONUNBUFFERED=1
# soundfile/soxr (and cffi) are not on that image: carried as wheels in .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
# in artifacts/ (ignored, not hidden): it survives between calls to a warm machine, hidden folders do not
export VOXTRAL_RUNNER_CACHE=$PWD/artifacts/vr-cache
# Triton's compiled kernels likewise (the decode kernels' sweeps and the step's export reuse them)
export TRITON_CACHE_DIR=$PWD/artifacts/triton-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
