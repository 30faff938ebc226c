"""Supervise one engine that runs as a container: the process lifecycle, done the
container way (docs/containers.md).

`ContainerSupervisor` is an `EngineSupervisor` whose engine is a container of the
agent's runtime (`containers.ContainerRuntime`):

- before the first launch the image is pulled when the runtime lacks it (phase
  `pulling`, with bytes done and total), its version read, and the release row chosen
  (`on_image`); a failed pull fails the deployment with the runtime's message;
- the launch creates and starts the container (labelled with the deployment, the host
  and the spec's hash); its exit is seen through the runtime's wait, with the exit code;
- a crash is restarted with the same backoff as a process; the agent log and the report
  carry the exit code and the container's last lines;
- drain and stop send SIGTERM through the runtime, then SIGKILL after the grace, and
  remove the container;
- a successor agent adopts the running container from its labels (`adopt_container`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gearshift.agents.config import ContainersConfig
from gearshift.agents.runtimes.base import LaunchPlan
from gearshift.agents.runtimes.containers import (
    LABEL_DEPLOYMENT,
    LABEL_HOST,
    LABEL_PORT,
    LABEL_RESTARTS,
    LABEL_SERVED,
    LABEL_SPEC,
    LABEL_SPEC_HASH,
    ContainerError,
    ContainerInfo,
    ContainerRuntime,
    ImageInfo,
    Mount,
    PullProgress,
    container_name,
    container_request,
    read_secret_env,
    spec_hash,
    spec_json,
)
from gearshift.agents.runtimes.supervisor import EngineHandle, EngineSupervisor
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.errors import GearshiftError
from gearshift.common.spec import Phase

log = logging.getLogger(__name__)

WAIT_RETRY_S = 1.0  # the runtime's API dropped a wait: ask again after this
HF_CACHE = ".cache/huggingface"


class ContainerHandle:
    """A running engine container, with the operations of `EngineHandle`. Signals go
    through the runtime's API; the exit code is the runtime's (128 + a signal)."""

    def __init__(self, runtime: ContainerRuntime, container_id: str, pid: int) -> None:
        self.runtime = runtime
        self.container_id = container_id
        self.pid = pid
        self.returncode: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._exited = asyncio.ensure_future(self._wait())

    async def _wait(self) -> int:
        while True:
            try:
                code = await self.runtime.wait(self.container_id)
                break
            except ContainerError as exc:
                # The API dropped the wait (its service restarted): the container may
                # well run on. Ask its state, and wait again while it runs.
                try:
                    state = await self.runtime.state(self.container_id)
                except ContainerError:
                    state = {"Running": True}
                if state is None:
                    code = -1
                    break
                if not state.get("Running", False):
                    code = int(state.get("ExitCode", -1))
                    break
                log.debug("wait for %s: %s; asking again", self.container_id[:12], exc)
                await asyncio.sleep(WAIT_RETRY_S)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        task = asyncio.ensure_future(self._kill(signal.Signals(sig).name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _kill(self, name: str) -> None:
        try:
            await self.runtime.kill(self.container_id, name)
        except ContainerError as exc:
            log.warning("cannot send %s to container %s: %s", name, self.container_id[:12],
                        exc.message)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        """Stop watching (the container keeps running)."""
        self._exited.cancel()


class ContainerSupervisor(EngineSupervisor):
    """Runs and watches one engine deployment as a container (see the module doc)."""

    def __init__(self, *args: Any, containers: ContainerRuntime, settings: ContainersConfig,
                 image: str, host_id: str, gpus_emulated: bool,
                 on_image: Callable[[ImageInfo], Awaitable[EngineRelease | None]],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.containers = containers
        self.settings = settings
        self.image = image
        self.host_id = host_id
        self.gpus_emulated = gpus_emulated
        self._on_image = on_image
        self.image_info: ImageInfo | None = None
        self.pull = PullProgress()
        self.container_id = ""
        self.name = container_name(host_id, self.spec.deployment_id)

    @property
    def launch_host(self) -> str:
        # A published port reaches the engine from outside its network namespace.
        return self._bind_host if self.settings.network == "host" else "0.0.0.0"

    @property
    def image_digest(self) -> str:
        return self.image_info.digest if self.image_info is not None else ""

    @property
    def pull_bytes(self) -> tuple[int, int]:
        return self.pull.done, self.pull.total

    async def _prepare(self) -> bool:
        try:
            info = await self.containers.image(self.image)
            if info is None:
                self._set(Phase.PULLING, f"pulling {self.image}")
                info = await asyncio.wait_for(
                    self.containers.pull(self.image, self._pulled),
                    self.settings.pull_timeout_s)
            self.image_info = info
            self.release = await self._on_image(info)
        except ContainerError as exc:
            self._set(Phase.FAILED, exc.message)
            return False
        except TimeoutError:
            self._set(Phase.FAILED, f"pull of {self.image} did not finish within "
                                    f"{self.settings.pull_timeout_s:g} s")
            return False
        except GearshiftError as exc:  # e.g. a pinned version the image does not have
            self._set(Phase.FAILED, exc.message)
            return False
        return True

    def _pulled(self, progress: PullProgress) -> None:
        self.pull = progress
        self._message = f"pulling {self.image}: {progress.describe()}"

    def _labels(self) -> dict[str, str]:
        return {LABEL_DEPLOYMENT: self.spec.deployment_id, LABEL_HOST: self.host_id,
                LABEL_SPEC_HASH: spec_hash(self.spec), LABEL_SPEC: spec_json(self.spec),
                LABEL_PORT: str(self._port), LABEL_RESTARTS: str(self._restarts)}

    def _mounts(self) -> list[Mount]:
        facts = self.entry.image
        home = facts.home if facts is not None else "/root"
        mounts = [Mount(self.workdir.resolve(), str(self.workdir.resolve()))]
        if self.settings.model_cache is not None:
            mounts.append(Mount(self.settings.model_cache.resolve(), f"{home}/{HF_CACHE}"))
        mounts += [Mount(p.resolve(), str(p.resolve()), read_only=True)
                   for p in self.settings.model_dirs]
        return mounts

    async def _launch(self, plan: LaunchPlan) -> EngineHandle | None:
        facts = self.entry.image
        if facts is None:
            self._set(Phase.FAILED, f"{self.entry.display_name} has no container image facts")
            return None
        try:
            gpus = await self.containers.gpu_request(self.gpus_emulated)
            env: dict[str, str] = {**self._env, **plan.env}
            if gpus != "none":  # the runtime hands over only the spec's GPUs, from 0
                env.pop("CUDA_VISIBLE_DEVICES", None)
            env.update(read_secret_env(self.settings.secret_env_files))
            labels = {**self._labels(), LABEL_SERVED: plan.served_model_name}
            body = container_request(
                image=self.image_info.image_id if self.image_info else self.image,
                argv=plan.argv, facts=facts, env=env, labels=labels, settings=self.settings,
                gpu_request=gpus, gpu_indices=self.spec.gpu_indices,
                bind_host=self._bind_host, port=self._port, mounts=self._mounts(),
                stop_timeout_s=max(self.spec.shutdown_timeout_s, 1.0))
            container_id, pid = await self.containers.run(self.name, body)
        except ContainerError as exc:
            self._set(Phase.FAILED, exc.message)
            return None
        self.container_id = container_id
        with contextlib.suppress(OSError), self.log_path.open("a", encoding="utf-8") as f:
            f.write(f"=== gearshift: container {container_id[:12]} ({self.name}) of "
                    f"{self.image}: {' '.join(plan.argv)}\n")
        return ContainerHandle(self.containers, container_id, pid)

    def _describe(self, proc: EngineHandle) -> str:
        return f"container {self.container_id[:12]} ({self.image})"

    async def _last_lines(self) -> str:
        if not self.container_id:
            return ""
        return await self.containers.tail(self.container_id)

    def _kill_group(self) -> None:
        proc = self._proc
        if isinstance(proc, ContainerHandle) and proc.returncode is None:
            proc.send_signal(signal.SIGKILL)

    def _release_handle(self) -> None:
        if isinstance(self._proc, ContainerHandle):
            self._proc.close()

    async def _after_stop(self) -> None:
        if not self.container_id:
            return
        try:
            await self.containers.remove(self.container_id)
        except ContainerError as exc:
            log.warning("container %s of %s not removed: %s", self.container_id[:12],
                        self.spec.deployment_id, exc.message)

    async def adopt_container(self, found: ContainerInfo, pid: int) -> None:
        """Take over `found`, a running container a previous agent started."""
        labels = found.labels
        self.container_id = found.container_id
        self.image_info = await self.containers.image(self.image)
        plan = LaunchPlan(argv=(), served_model_name=labels.get(LABEL_SERVED, self.spec.model))
        await self._take_over(ContainerHandle(self.containers, found.container_id, pid),
                              int(labels[LABEL_PORT]), int(labels.get(LABEL_RESTARTS, "0")),
                              plan, f"container {found.container_id[:12]}")


def spec_from_labels(labels: Mapping[str, str]) -> dict[str, Any]:
    """The DeploymentSpec fields a container's labels carry (ValueError if unreadable)."""
    data = json.loads(labels[LABEL_SPEC])
    if not isinstance(data, dict):
        raise ValueError(f"label {LABEL_SPEC}: expected a JSON object")
    int(labels[LABEL_PORT])
    return data


__all__ = ["ContainerHandle", "ContainerSupervisor", "spec_from_labels"]
