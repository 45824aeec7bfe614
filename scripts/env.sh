# Sourced by the scripts: which Python environment llmplatform lives in.
# The active virtual environment if there is one, else the project's .venv ($LLMPLATFORM_VENV).
LLMPLATFORM_VENV="${LLMPLATFORM_VENV:-$PWD/.venv}"

llmplatform_python() {
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    echo "$VIRTUAL_ENV/bin/python"
  else
    echo "$LLMPLATFORM_VENV/bin/python"
  fi
}
