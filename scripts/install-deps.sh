#!/usr/bin/env bash
# Installs the build and test dependencies from Debian's packages
# (Debian 12 "bookworm"). Runs apt-get as root, or through sudo.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgloo-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libhwy-dev libdnnl-dev
  ocl-icd-opencl-dev  # required by libdnnl-dev's CMake config (find_package(OpenCL))
  libssl-dev  # OpenSSL::Crypto: bearer-token digests, TLS PEM checks (server/transport/auth.cc, server/transport/tls.cc)
  openssl     # the command line: server_security_test makes its certificates with it
  curl        # server_metrics_test scrapes /metrics with it
  prometheus  # promtool: server_metrics_test runs `promtool check metrics` on the scrape
  clang libclang-rt-14-dev  # libFuzzer + ASan/UBSan runtimes: tests/fuzz (ctest fuzz_*)
  clang-format clang-tidy   # scripts/lint.sh (scripts/test.sh): formatting and .clang-tidy checks
  python3-kubernetes python3-yaml  # tests/deploy: manifests validated against the Kubernetes API types
  python3 python3-grpcio python3-protobuf python3-numpy  # Python client (client/python) and its ctest py_client_*;
                                                         # its stubs come from protoc + grpc_python_plugin (protobuf-compiler-grpc)
  python3-torch  # Python client: torch tensors in and out (py_client_TorchTest)
  python3-hypothesis  # py_client_ReassemblyPropertyTest: property tests of the ScoreChunked answer reassembly
  python3-venv python3-pip python3-setuptools python3-wheel  # py_client_PackageTest: pip install ./client/python into a venv, offline
  mypy  # py_client_typecheck: the Python client's type hints
  python3-requests python3-typing-extensions  # examples/: transformers' dependencies that its virtual environment
                                              # takes from Debian (scripts/setup-examples.sh, ctest example_*)
)
# kubectl for `kubectl kustomize` (tests/deploy): Debian's kubernetes-client,
# unless a kubectl is installed already (another package owning
# /usr/bin/kubectl, e.g. Google Cloud SDK's, would conflict with it).
if ! command -v kubectl >/dev/null 2>&1; then PACKAGES+=(kubernetes-client); fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
