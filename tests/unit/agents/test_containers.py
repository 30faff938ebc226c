"""The container launcher's pure parts: the Docker Engine API create request for each
engine and runtime, the config block, versions from image tags and labels.

Docker itself is not run on these machines: `dockerd` from Debian's docker.io needs
iptables and a cgroup setup this sandbox lacks, so the requests that differ for Docker
(the CDI device request, Docker's GPU request, capped ulimits) are checked here as the
Docker Engine API documents them; the same code path runs against Podman's compatible
API in tests/integration/test_engine_containers.py."""

from __future__ import annotations

import asyncio
import json
import resource
from pathlib import Path

import pytest

from gearshift.agents.config import ContainersConfig, parse_agent_config
from gearshift.agents.runtimes.containers import (
    LABEL_DEPLOYMENT,
    ImageInfo,
    Mount,
    container_name,
    container_request,
    grantable_ulimits,
    image_version,
    read_secret_env,
    spec_hash,
    spec_json,
    version_from_tag,
)
from gearshift.common.engines import engine_entry
from gearshift.common.errors import ConfigError, GearshiftError
from gearshift.common.spec import DeploymentSpec

ARGV_VLLM = ("vllm", "serve", "org/m", "--host", "127.0.0.1", "--port", "8000")
ARGV_TRT = ("trtllm-serve", "org/m", "--host", "127.0.0.1", "--port", "8001")


def _request(engine: str, argv: tuple[str, ...], *, runtime: str = "podman",
             gpu_request: str = "cdi", gpu_indices: tuple[int, ...] = (2, 3),
             **settings: object) -> dict:
    facts = engine_entry(engine).image
    assert facts is not None
    return container_request(
        image="img:1", argv=argv, facts=facts, env={"A": "1"},
        labels={LABEL_DEPLOYMENT: "d1"},
        settings=ContainersConfig(runtime=runtime, **settings),  # type: ignore[arg-type]
        gpu_request=gpu_request, gpu_indices=gpu_indices, bind_host="10.0.0.5", port=8000,
        mounts=[Mount(Path("/w/d1"), "/w/d1"), Mount(Path("/models"), "/models", True)],
        stop_timeout_s=30)


def test_vllm_sets_its_entrypoint_and_passes_the_rest_as_the_command() -> None:
    body = _request("vllm", ARGV_VLLM)
    assert body["Entrypoint"] == ["vllm"]
    assert body["Cmd"] == list(ARGV_VLLM[1:])


def test_nvidia_images_keep_their_entrypoint_and_get_the_whole_command_line() -> None:
    body = _request("tensorrt-llm", ARGV_TRT)
    assert "Entrypoint" not in body
    assert body["Cmd"] == list(ARGV_TRT)
    sglang = ("python3", "-m", "sglang.launch_server", "--model-path", "org/m")
    assert _request("sglang", sglang)["Cmd"] == list(sglang)


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_gpus_by_cdi_name_each_index_of_the_spec(runtime: str) -> None:
    host = _request("vllm", ARGV_VLLM, runtime=runtime)["HostConfig"]
    assert host["DeviceRequests"] == [{"Driver": "cdi",
                                       "DeviceIDs": ["nvidia.com/gpu=2", "nvidia.com/gpu=3"]}]


def test_dockers_gpu_request_names_the_indices() -> None:
    host = _request("vllm", ARGV_VLLM, runtime="docker", gpu_request="nvidia")["HostConfig"]
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "DeviceIDs": ["2", "3"],
                                       "Capabilities": [["gpu"]]}]


@pytest.mark.parametrize("gpu_request,indices", [("none", (2, 3)), ("cdi", ())])
def test_no_gpus_on_an_emulated_inventory_or_an_empty_spec(gpu_request: str,
                                                            indices: tuple[int, ...]) -> None:
    host = _request("vllm", ARGV_VLLM, gpu_request=gpu_request, gpu_indices=indices)
    assert "DeviceRequests" not in host["HostConfig"]


def test_host_network_ipc_and_mounts() -> None:
    body = _request("vllm", ARGV_VLLM)
    host = body["HostConfig"]
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host"
    assert "ShmSize" not in host and "PortBindings" not in host
    assert host["Binds"] == ["/w/d1:/w/d1:rw", "/models:/models:ro"]
    assert host["RestartPolicy"] == {"Name": "no"}
    assert body["StopSignal"] == "SIGTERM" and body["StopTimeout"] == 30
    assert body["Labels"] == {LABEL_DEPLOYMENT: "d1"} and body["Env"] == ["A=1"]


def test_a_published_port_and_a_shm_size_instead() -> None:
    body = _request("vllm", ARGV_VLLM, network="publish", ipc_host=False, shm_size="2g")
    host = body["HostConfig"]
    assert "NetworkMode" not in host and "IpcMode" not in host
    assert host["ShmSize"] == 2 * 1024 ** 3
    assert host["PortBindings"] == {"8000/tcp": [{"HostIp": "10.0.0.5", "HostPort": "8000"}]}
    assert body["ExposedPorts"] == {"8000/tcp": {}}


def test_tensorrt_llm_asks_for_its_documented_ulimits_within_what_may_be_granted() -> None:
    ulimits = {u["Name"]: u["Hard"] for u in _request("tensorrt-llm", ARGV_TRT)
               ["HostConfig"]["Ulimits"]}
    assert set(ulimits) == {"memlock", "stack"}
    for name, limit in (("memlock", resource.RLIMIT_MEMLOCK), ("stack", resource.RLIMIT_STACK)):
        hard = resource.getrlimit(limit)[1]
        want = {"memlock": -1, "stack": 67108864}[name]
        if hard == resource.RLIM_INFINITY:
            assert ulimits[name] == want
        else:  # never more than the runtime could grant, never more than asked
            assert ulimits[name] <= hard and (want == -1 or ulimits[name] <= want)
    assert _request("vllm", ARGV_VLLM)["HostConfig"]["Ulimits"] == []


def test_configured_ulimits_come_on_top_of_the_catalogs() -> None:
    body = _request("vllm", ARGV_VLLM, ulimits={"nofile": 1024, "nproc": 512})
    assert {u["Name"]: u["Soft"] for u in body["HostConfig"]["Ulimits"]} == \
        {"nofile": 1024, "nproc": 512}
    assert grantable_ulimits({}) == []


def test_secrets_come_from_files_and_a_missing_one_is_named(tmp_path: Path) -> None:
    token = tmp_path / "hf.token"
    token.write_text("hf_secret\n")
    assert read_secret_env({"HF_TOKEN": token}) == {"HF_TOKEN": "hf_secret"}
    with pytest.raises(GearshiftError, match=r"secret_env_files\.HF_TOKEN: cannot read .*nope"):
        read_secret_env({"HF_TOKEN": tmp_path / "nope"})


def test_the_spec_label_round_trips_and_its_hash_follows_the_spec() -> None:
    spec = DeploymentSpec(deployment_id="d1", model="m", engine="vllm", gpu_indices=(0, 1),
                          tensor_parallel_size=2)
    assert DeploymentSpec(**json.loads(spec_json(spec))) == spec
    other = DeploymentSpec(deployment_id="d1", model="m", engine="vllm", gpu_indices=(2, 3),
                           tensor_parallel_size=2)
    assert spec_hash(spec) != spec_hash(other) and len(spec_hash(spec)) == 16
    assert container_name("host a/b", "d1") == "gearshift-host_a_b-d1"


@pytest.mark.parametrize("ref,version", [
    ("docker.io/vllm/vllm-openai:v0.11.0", "0.11.0"),
    ("nvcr.io/nvidia/tensorrt-llm/release:1.2.0rc4", "1.2.0rc4"),
    ("localhost:5000/sglang:0.5.7-cu129", "0.5.7"),
    ("docker.io/lmsysorg/sglang:latest", ""),
    ("localhost:5000/sglang", ""),
    ("img@sha256:" + "0" * 64, ""),
])
def test_version_from_tag(ref: str, version: str) -> None:
    assert version_from_tag(ref) == version


class _NoMetadata:
    """A runtime whose images hold no readable package metadata."""

    async def package_version(self, image: str, package: str) -> str:
        return ""


@pytest.mark.parametrize("labels,env,ref,found", [
    ({"org.opencontainers.image.title": "gearshift-emulated-vllm",
      "org.opencontainers.image.version": "0.11.0"}, {}, "x:latest", ("0.11.0", "image-label")),
    # Ubuntu's label, inherited by an image built FROM it: not the engine's version.
    ({"org.opencontainers.image.ref.name": "ubuntu",
      "org.opencontainers.image.version": "22.04"}, {}, "x:v0.10.2", ("0.10.2", "image-tag")),
    ({}, {}, "x:latest", ("", "")),
])
def test_the_image_version_trusts_only_a_label_of_the_engines(
        labels: dict[str, str], env: dict[str, str], ref: str, found: tuple[str, str]) -> None:
    info = ImageInfo(reference=ref, image_id="sha256:1", digest="sha256:1", labels=labels, env=env)
    got = asyncio.run(image_version(_NoMetadata(), info, engine_entry("vllm")))  # type: ignore[arg-type]
    assert got == found


def test_tensorrt_llms_version_from_its_images_environment() -> None:
    info = ImageInfo(reference="x:latest", image_id="i", digest="i", labels={},
                     env={"TRT_LLM_VERSION": "1.2.0"})
    got = asyncio.run(image_version(_NoMetadata(), info, engine_entry("tensorrt-llm")))  # type: ignore[arg-type]
    assert got == ("1.2.0", "image-env")


@pytest.mark.parametrize("data,error", [
    ({"engines": {"vllm": {"image": "localhost/x:1"}}},
     "engines vllm run from images: give a 'containers' block"),
    ({"containers": {}, "engines": {"vllm": {"image": "Bad Ref"}}},
     "engines.vllm.image: expected an image reference"),
    ({"containers": {}, "engines": {"vllm": {"image": "x:1", "executable": ["vllm"]}}},
     "engines.vllm: give image or executable, not both"),
    ({"containers": {"runtime": "lxc"}}, "containers.runtime"),
    ({"containers": {"endpoint": "/run/podman.sock"}},
     "containers.endpoint: expected unix:///path/to.sock"),
    ({"containers": {"shm_size": "lots"}}, "containers.shm_size"),
    ({"containers": {"ulimits": {"fsize": 1}}}, "unknown ulimit 'fsize'"),
    ({"containers": {"secret_env_files": {"HF TOKEN": "/x"}}}, "not an environment variable"),
])
def test_a_bad_containers_config_names_the_field(data: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(".", r"\.")):
        parse_agent_config(data)


def test_a_containers_config_parses_with_the_runtimes_default_socket() -> None:
    cfg = parse_agent_config({"containers": {"runtime": "docker"},
                              "engines": {"vllm": {"image": "docker.io/vllm/vllm-openai:v0.11.0"}}})
    assert cfg.containers is not None
    assert cfg.containers.socket_url == "unix:///var/run/docker.sock"
    assert ContainersConfig().socket_url == "unix:///run/podman/podman.sock"


def test_the_shipped_container_example_is_a_valid_agent_config() -> None:
    from gearshift.agents.config import load_agent_config

    root = Path(__file__).resolve().parents[3]
    cfg = load_agent_config(root / "deploy" / "examples" / "agent-containers.yaml")
    assert cfg.containers is not None and cfg.containers.runtime == "podman"
    assert {n: e.image for n, e in cfg.engines.items()} == {
        "vllm": "docker.io/vllm/vllm-openai:v0.11.0",
        "tensorrt-llm": "nvcr.io/nvidia/tensorrt-llm/release:1.2.0",
        "sglang": "docker.io/lmsysorg/sglang:v0.5.7"}
