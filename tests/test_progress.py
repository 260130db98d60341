"""Progress bars (minigen.paths.bar): drawn on stderr when it is a terminal, never otherwise."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from conftest import tiny_hf
from test_loading import save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
BAR_MARKS = ("\r", "█", "step/s]", "s/step]", "profile:")  # what a drawn tqdm bar leaves in a stream


@pytest.fixture(scope="module")
def progress_folder(tmp_path_factory):
    """A tiny Llama folder with a tokenizer, for `python -m minigen profile`."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_hf("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def _profile_cli(folder: Path, cwd: Path, stderr) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minigen", "profile", "--model", str(folder), "--steps", "2",
                           "--prompt-len", "8", "--json", "p.json"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=stderr, text=True, timeout=300)


def test_no_bar_when_stderr_is_not_a_terminal(progress_folder, tmp_path):
    """`profile` with pipes (a CI log, a test, `> out.txt`): no bar in stderr, stdout or the JSON."""
    done = _profile_cli(progress_folder, tmp_path, subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    assert "matrix products" in done.stdout  # it ran, and printed its table
    for stream in (done.stdout, done.stderr, (tmp_path / "p.json").read_text()):
        assert not [m for m in BAR_MARKS if m in stream], stream
    json.loads((tmp_path / "p.json").read_text())


def test_a_bar_when_stderr_is_a_terminal(progress_folder, tmp_path):
    """The same command with stderr on a pseudo-terminal: the bar is drawn there, and stdout (a pipe)
    still has none."""
    master, slave = pty.openpty()
    # a fresh pty is 0 columns wide, where tqdm draws an empty line: give it a terminal's 24 x 80
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        done = _profile_cli(progress_folder, tmp_path, slave)
        drawn = ""
        while select.select([master], [], [], 1.0)[0]:  # what the command wrote to its terminal
            drawn += os.read(master, 1 << 16).decode(errors="replace")
    finally:
        os.close(slave)
        os.close(master)
    assert done.returncode == 0, drawn
    assert "profile:" in drawn and "\r" in drawn, drawn
    assert not [m for m in BAR_MARKS if m in done.stdout], done.stdout
