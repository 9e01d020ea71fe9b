"""The offline images against the real engine: who they run as and what they hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from substrate.sandbox.images import build as imagebuild

Run = Callable[[str, list[str]], tuple[int, str]]


@pytest.fixture
def run(docker_client: Any, test_labels: dict[str, str]) -> Run:
    """Run argv in a fresh, network-less, labelled container: (exit code, output)."""

    def run(image: str, argv: list[str]) -> tuple[int, str]:
        container = docker_client.containers.create(
            image, argv, labels=test_labels, network_mode="none"
        )
        try:
            container.start()
            status = container.wait(timeout=120)
            output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
        finally:
            container.remove(force=True)
        return int(status["StatusCode"]), output

    return run


def test_tiny_runs_echo_as_uid_1000(run: Run, tiny_image: str) -> None:
    code, output = run(tiny_image, ["sh", "-c", 'echo "$(id -u):$(id -g) hi"'])
    assert (code, output) == (0, "1000:1000 hi\n")


def test_tiny_has_a_sticky_tmp_and_a_passwd_entry(run: Run, tiny_image: str) -> None:
    code, output = run(tiny_image, ["sh", "-c", "stat -c %a /tmp; id -un; touch /tmp/x"])
    assert (code, output) == (0, "1777\nagent\n")


def test_sandbox_runs_as_uid_1000_by_default(
    run: Run, docker_client: Any, sandbox_image: str
) -> None:
    code, output = run(sandbox_image, ["id"])
    assert code == 0
    assert output.startswith("uid=1000(agent) gid=1000(agent)")
    config = docker_client.images.get(sandbox_image).attrs["Config"]
    assert config["User"] == "1000:1000"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python3", "-m", "pytest", "--version"], "pytest "),
        (["git", "--version"], "git version "),
        (["bash", "-c", "echo $BASH_VERSION"], "5."),
        (["ps", "--version"], "ps from procps-ng"),
        # A project sets itself up: pip, venv (its ensurepip), setuptools and wheel.
        (["python3", "-m", "pip", "--version"], "pip "),
        (["python3", "-c", "import ensurepip; print(ensurepip.version())"], "23."),
        (["python3", "-c", "import setuptools, wheel; print('build ok')"], "build ok"),
        (["ls", "--version"], "ls (GNU coreutils)"),
    ],
)
def test_sandbox_has_the_tools(
    run: Run, sandbox_image: str, argv: list[str], expected: str
) -> None:
    code, output = run(sandbox_image, argv)
    assert code == 0, output
    assert output.startswith(expected)


def test_sandbox_runs_pytest_as_uid_1000(run: Run, sandbox_image: str) -> None:
    script = (
        "cd /tmp && printf 'def test_one():\\n    assert 1 + 1 == 2\\n' > test_one.py"
        " && python3 -m pytest -q -p no:cacheprovider test_one.py"
    )
    code, output = run(sandbox_image, ["bash", "-c", script])
    assert code == 0, output
    assert "1 passed" in output


def test_sandbox_base_was_made_offline(docker_client: Any, sandbox_image: str) -> None:
    # The default build starts from the debootstrap import, never from a registry image.
    history = docker_client.images.get(sandbox_image).history()
    assert any(layer.get("Comment") == "Imported from -" for layer in history)
    labels = docker_client.images.get(imagebuild.BASE_TAG).attrs["Config"]["Labels"]
    assert labels["substrate.image"] == "base"


def test_images_are_current_so_a_second_build_is_a_no_op(
    sandbox_image: str, tiny_image: str
) -> None:
    lines: list[str] = []
    imagebuild.build_images("all", False, lines.append)
    assert lines == [
        f"{imagebuild.SANDBOX_TAG}: present and current",
        f"{imagebuild.TINY_TAG}: present and current",
    ]


def test_top_level_dockerfile_equals_the_packaged_copy() -> None:
    top = imagebuild.sandbox_dockerfile()
    packaged = imagebuild.packaged_sandbox_dockerfile()
    assert top != packaged, "the checkout's top-level Dockerfile was not found"
    assert top.read_bytes() == packaged.read_bytes()
