"""`.ci/install.py`: the Makefile's installs through uv take pip's configuration (indexes, find-links, certificate,
scopes in pip's order) and pip's rule of the best version across indexes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ci_install", REPO / ".ci" / "install.py")
ci_install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci_install)


def test_pips_own_configuration_reaches_uv(monkeypatch, tmp_path):
    """Read through `pip config list` for real: a variable (PIP_*) overrides the config file's value."""
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url = file:///a/simple file:///b/simple\nindex-url = file:///file\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_INDEX_URL", "file:///env")
    monkeypatch.setenv("PIP_FIND_LINKS", "wheels")
    settings = ci_install.pip_settings(sys.executable)
    assert settings["index-url"] == "file:///env" and settings["find-links"] == "wheels"
    flags, env = ci_install.uv_flags({**settings, "cert": "ca.pem"})
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version of any index
    pairs = list(zip(flags[2::2], flags[3::2]))
    assert ("--index-url", "file:///env") in pairs and ("--find-links", "wheels") in pairs
    assert [v for f, v in pairs if f == "--extra-index-url"] == ["file:///a/simple", "file:///b/simple"]
    assert env == {"SSL_CERT_FILE": "ca.pem"}
    assert ci_install.uv_flags({"no-index": "true"})[0][-1] == "--no-index"


def test_pip_installs_when_asked(monkeypatch, capsys):
    """HF_LLMKIT_INSTALLER=pip: pip itself (here asked for its version of nothing: `--help` of install)."""
    monkeypatch.setenv("HF_LLMKIT_INSTALLER", "pip")
    assert ci_install.main([sys.executable, "--help"]) == 0
    assert f"+ {sys.executable} -m pip install --help" in capsys.readouterr().out
