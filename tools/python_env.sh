# Sourced by the project's scripts: the Python environment tools/setup.sh
# installs from tools/python.lock. DTE_VENV chooses another place for it.
DTE_VENV=${DTE_VENV:-/opt/dte/venv}
DTE_PYTHON=$DTE_VENV/bin/python
export DTE_VENV DTE_PYTHON
