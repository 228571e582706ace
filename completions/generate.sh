#!/usr/bin/env bash
# Regenerate the completion scripts from the app itself:  bash completions/generate.sh
# tests/test_cli_startup.py fails when these files are stale.
set -euo pipefail
# Name the shell explicitly rather than let Typer detect the one running this script.
cd "$(dirname "$0")"
_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION=1 python -m treecli --show-completion bash > treecli.bash
_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION=1 python -m treecli --show-completion zsh > _treecli
_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION=1 python -m treecli --show-completion fish > treecli.fish
