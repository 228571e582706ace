"""Completion in real shells, typed into tmux as a person would: the first TAB of a
new shell, for commands and for key paths (issue 15, point 10). Each shell's test
runs where that shell is installed (apt-get install zsh fish tmux)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent  # where the treecli console script is


def _tmux_session(tmp_path, command: str) -> str:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    name = f"treecli-{os.getpid()}-{tmp_path.name}"[:60]
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(tmp_path), "TERM": "xterm"}
    subprocess.run(["tmux", "-L", name, "new-session", "-d", "-s", name, "-x", "200", "-y", "50", command],
                   check=True, env=env, cwd=ROOT)
    return name


def _type(name: str, *keys: str) -> None:
    subprocess.run(["tmux", "-L", name, "send-keys", "-t", name, *keys], check=True)


def _screen_until(name: str, wanted: str, seconds: float = 30) -> str:
    deadline = time.time() + seconds
    screen = ""
    while time.time() < deadline:
        screen = subprocess.run(["tmux", "-L", name, "capture-pane", "-p", "-t", name], capture_output=True,
                                text=True).stdout
        if wanted in screen:
            return screen
        time.sleep(0.2)
    return screen


@pytest.fixture
def kill_tmux():
    names = []
    yield names
    for name in names:
        subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True)


SHELLS = {
    # shell: (command line, set-up typed first)
    "zsh": ("zsh -f", f"fpath=({ROOT / 'completions'} $fpath); autoload -Uz compinit; compinit -u; PS1='$ '"),
    "bash": ("bash --norc --noprofile", f"source {ROOT / 'completions' / 'treecli.bash'}; PS1='$ '"),
    "fish": ("fish --no-config", f"source {ROOT / 'completions' / 'treecli.fish'}"),
}


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_the_first_tab_of_a_new_shell_completes_commands_and_key_paths(tmp_path, shell, kill_tmux):
    if shutil.which(shell) is None:
        pytest.skip(f"needs {shell}")
    command, setup = SHELLS[shell]
    name = _tmux_session(tmp_path, command)
    kill_tmux.append(name)
    _type(name, setup, "Enter")
    _type(name, "clear", "Enter")
    _type(name, "treecli sho", "Tab")
    assert "treecli show" in _screen_until(name, "treecli show"), shell
    _type(name, " examples/tiny.safetensors --where model.norm", "Tab")
    screen = _screen_until(name, "model.norm.weight")
    assert "model.norm.weight" in screen or "--where model.norm" in screen, screen
    _type(name, "C-c")
    _type(name, "treecli edit examples/tiny.safetensors --cast lm_h", "Tab")
    assert "lm_head" in _screen_until(name, "--cast lm_head"), shell


def test_install_completion_for_zsh_writes_the_script_that_completes_the_first_tab(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    proc = subprocess.run([sys.executable, "-m", "treecli", "--install-completion", "zsh"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    installed = (tmp_path / ".zfunc" / "_treecli").read_text()
    assert installed.strip() == (ROOT / "completions" / "_treecli").read_text().strip()
    assert '"${funcstack[1]}" == "_treecli"' in installed
    assert "compinit" in (tmp_path / ".zshrc").read_text()


def test_bash_completes_a_dtype_after_an_unquoted_equals_sign(tmp_path, kill_tmux):
    """bash splits `--cast KEY=bf` at `=` (COMP_WORDBREAKS) and replaces only `bf`."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    command, setup = SHELLS["bash"]
    name = _tmux_session(tmp_path, command)
    kill_tmux.append(name)
    _type(name, setup, "Enter")
    _type(name, "clear", "Enter")
    _type(name, "treecli edit examples/tiny.safetensors --cast model.norm.weight=bfl", "Tab")
    screen = _screen_until(name, "--cast model.norm.weight=bfloat16")
    assert "--cast model.norm.weight=bfloat16" in screen, screen
    assert "model.norm.weight=model.norm.weight" not in screen


def test_words_bash_split_at_an_equals_sign_are_rejoined():
    from treecli.cli._complete import rejoined_at_equals

    words = ["treecli", "edit", "x", "--cast", "k.w", "=", "bf"]
    assert rejoined_at_equals(words, 6) == (["treecli", "edit", "x", "--cast", "k.w=bf"], 4, "k.w=")
    assert rejoined_at_equals(words[:6], 5) == (["treecli", "edit", "x", "--cast", "k.w="], 4, "k.w=")
    assert rejoined_at_equals(words[:6] + [""], 6) == (["treecli", "edit", "x", "--cast", "k.w="], 4, "k.w=")
    assert rejoined_at_equals(["treecli", "show", "x"], 2) == (["treecli", "show", "x"], 2, "")
