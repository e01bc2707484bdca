# Sourced by scripts/bench and scripts/test: creates or reuses the project's virtual environments.
#   .venv        Python 3.12 + jax, the Pallas kernels and the dev tools (most tests, benchmarks)
#   .venv-torch  Python 3.11 + torch==2.13.0 (CPU wheel) and no JAX (torch path, pure-numpy core)
#   .venv-easydel Python 3.12 + easydel==0.3.0 (pins jax 0.9.2) + hicache_jax without its jax extra
#                (the EasyDeL integration tests, tests/integrations)
# An environment is rebuilt when pyproject.toml changes (its hash is stamped inside the venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1

_find_python() {  # $1 = major.minor; prints an interpreter path or nothing
  local v="$1" c
  for c in "python$v" "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/$v"*/bin/python3; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in $(pyenv versions --bare 2>/dev/null | grep "^$v" | sort -rV); do
      echo "$(pyenv root)/versions/$c/bin/python3"; return 0
    done
  fi
  if command -v python3 >/dev/null 2>&1 && python3 -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))"; then
    command -v python3; return 0
  fi
}

_stamp() { { cat "$ROOT/pyproject.toml"; echo "$*"; } | sha256sum | cut -c1-16; }

_ensure_venv() {  # $1 = dir, $2 = python version, rest = pip install arguments
  local dir="$ROOT/$1" ver="$2"; shift 2
  local want; want="$(_stamp "$@")"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.hicache-stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  local py; py="$(_find_python "$ver")"
  if [ -z "$py" ]; then
    echo "error: Python $ver not found (tried python$ver, pyenv versions $ver.*)" >&2; return 1
  fi
  echo ">> creating ${dir#$ROOT/} with $py ($("$py" --version)) ..." >&2
  rm -rf "$dir"
  "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
  (cd "$ROOT" && "$dir/bin/python" -m pip install -q "$@")
  echo "$want" > "$dir/.hicache-stamp"
}

# The Debian libraries the mooncake wheel links against (libibverbs, librdmacm, libnuma).
# Installed when missing and we are root; otherwise (or if apt fails) the Mooncake tests
# skip and say why. Never fails the caller.
ensure_mooncake_libs() {
  local missing=() lib
  command -v ldconfig >/dev/null 2>&1 || return 0
  for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    ldconfig -p 2>/dev/null | grep -q "${lib%%:*} " || missing+=("${lib##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo ">> note: ${missing[*]} missing and not root (or no apt-get): the Mooncake tests will skip" >&2
    return 0
  fi
  echo ">> installing ${missing[*]} (for the mooncake L3 backend) ..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >/dev/null 2>&1 || echo ">> note: apt-get install ${missing[*]} failed: the Mooncake tests will skip" >&2
  return 0
}

ensure_jax_env() { ensure_mooncake_libs; _ensure_venv .venv 3.12 -e ".[jax,engine,storage,metrics,bench,dev,mooncake]"; }
ensure_torch_env() { _ensure_venv .venv-torch 3.11 "torch==2.13.0" -e ".[dev]"; }

# EasyDeL 0.3.0 pins jax/jaxlib 0.9.2 (its API moves fast: keep the pin); hicache_jax goes in
# without the [jax] extra so pip keeps that jax. Pillow is an undeclared dependency of easydel.
# Returns non-zero (and says why) when it cannot be built; the caller skips the run then.
ensure_easydel_env() {
  # A child shell: here (the left side of a ||) set -e would not stop a failed pip install.
  bash -c "source '$ROOT/scripts/_env.sh' && _ensure_venv .venv-easydel 3.12 -e '.[easydel,storage,metrics,dev]'" \
    || return 1
  "$ROOT/.venv-easydel/bin/python" -m pip check >&2 || echo ">> note: pip check reports conflicts in .venv-easydel" >&2
}
