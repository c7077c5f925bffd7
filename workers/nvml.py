"""GPU figures through NVML (pynvml), or through a JSON-backed fake where no GPU exists.

`GpuProbe` is the only thing the daemon's sampler and the doctor's resource check talk to.
Without a driver it says so once and then answers every question with an empty result, so
the daemon runs the same on a laptop, in CI and on a GPU host.

Pure (stdlib + pynvml, whose ctypes binding loads the driver only in nvmlInit): both the
daemon and the workers import it, so it sits at the top of eyas.workers: the one module of
the workers the daemon may import (tests/unit/test_import_rules.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FAKE_ENV = "EYAS_FAKE_NVML"


def load_nvml() -> Any:
    """The NVML module to use: a `JsonFakeNvml` when $EYAS_FAKE_NVML names a file, else pynvml.

    Raises ImportError when nvidia-ml-py is not installed; `GpuProbe.start` turns that
    into "no GPU metrics".
    """
    fake = os.environ.get(FAKE_ENV)
    if fake:
        return JsonFakeNvml(fake)
    import pynvml  # lazy: only the sampler and the doctor need it, and only once

    return pynvml


class JsonFakeNvml:
    """A stand-in for the pynvml module, backed by a JSON file, for machines without a GPU.

    It offers the functions and attribute names of pynvml that `GpuProbe` uses, and raises
    pynvml's own NVMLError classes, so `except pynvml.NVMLError` treats it like the real thing.
    The file is re-read whenever it changes, so a test can move GPU memory while the daemon runs:

        {"devices": [{"name": "NVIDIA H200", "uuid": "GPU-0", "mem_total": 150000000000,
                      "mem_used": 1000, "util": 0, "processes": [{"pid": 123, "mem": 5000}],
                      "graphics_processes": [...], "error": "GpuIsLost"}]}
        {"error": "LibraryNotFound"}          # no driver: nvmlInit raises

    A device's optional "error" names the NVMLError_<name> its queries raise (a lost GPU).
    """

    def __init__(self, path: str | os.PathLike[str]):
        import pynvml  # pure Python (ctypes loads the library only in nvmlInit): safe anywhere

        self._pynvml = pynvml
        self.NVMLError = pynvml.NVMLError
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._data: dict[str, Any] = {}
        self._initialized = 0

    def __getattr__(self, name: str) -> Any:
        # The NVMLError_* subclasses and NVML_* constants come straight from pynvml.
        if name.startswith(("NVMLError_", "NVML_")):
            return getattr(self._pynvml, name)
        raise AttributeError(name)

    # --- file handling

    def _load(self) -> dict[str, Any]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise ValueError(
                f"{FAKE_ENV}={self.path}: no such file; write the fake GPU JSON there or unset the variable"
            ) from None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict):
                    raise ValueError("expected a JSON object with 'devices'")
            except (OSError, ValueError) as exc:
                if self._stamp is not None:
                    return self._data  # caught mid-write: keep the last good copy, retry next call
                raise ValueError(f"{FAKE_ENV}={self.path}: not valid fake NVML JSON ({exc}); fix the file") from None
            self._data, self._stamp = data, stamp
        return self._data

    def _error(self, name: str) -> Exception:
        cls = getattr(self._pynvml, f"NVMLError_{name}", None)
        return cls() if cls is not None else self._pynvml.NVMLError(self._pynvml.NVML_ERROR_UNKNOWN)

    def _device(self, handle: int) -> dict[str, Any]:
        if not self._initialized:
            raise self._error("Uninitialized")
        devices = self._load().get("devices", [])
        if not isinstance(handle, int) or not 0 <= handle < len(devices):
            raise self._error("GpuIsLost")
        device = devices[handle]
        if device.get("error"):
            raise self._error(device["error"])
        return device

    # --- the pynvml functions GpuProbe calls

    def nvmlInit(self) -> None:
        data = self._load()
        if data.get("error"):
            raise self._error(data["error"])
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        if not self._initialized:
            raise self._error("Uninitialized")
        self._initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        if not self._initialized:
            raise self._error("Uninitialized")
        return len(self._load().get("devices", []))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._device(index)
        return index  # the handle is the index: the device is looked up afresh on every call

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(self._device(handle).get("name", "Fake GPU"))

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self._device(handle).get("uuid", f"GPU-fake-{handle}"))

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        d = self._device(handle)
        used, total = int(d.get("mem_used", 0)), int(d.get("mem_total", 0))
        return SimpleNamespace(used=used, total=total, free=max(total - used, 0))

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        d = self._device(handle)
        return SimpleNamespace(gpu=int(d.get("util", 0)), memory=int(d.get("mem_util", 0)))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return self._processes(handle, "processes")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return self._processes(handle, "graphics_processes")

    def _processes(self, handle: int, key: str) -> list[SimpleNamespace]:
        # "mem": null stands for NVML_VALUE_NOT_AVAILABLE, which pynvml reports as None.
        return [
            SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=p.get("mem")) for p in self._device(handle).get(key, [])
        ]


class GpuProbe:
    """Device and per-process GPU memory figures; empty results (never an exception) without NVML."""

    def __init__(self, nvml: Any = None, log: logging.Logger | None = None):
        self.nvml = nvml  # None: load_nvml() in start()
        self.log = log or logging.getLogger(__name__)
        self.available = False
        self._handles: dict[int, Any] = {}
        self._count = 0
        self._logged: set[str] = set()

    def _nvml_error(self) -> type[BaseException]:
        return getattr(self.nvml, "NVMLError", None) or Exception

    def start(self) -> bool:
        """Initialise NVML; False (after one info line) when there is no driver or no pynvml."""
        try:
            if self.nvml is None:
                self.nvml = load_nvml()
            self.nvml.nvmlInit()
            self._count = int(self.nvml.nvmlDeviceGetCount())
        except ImportError as exc:
            return self._off(f"pynvml not importable: {exc}")
        except self._nvml_error() as exc:
            return self._off(f"{type(exc).__name__}: {exc}")
        except OSError as exc:  # a broken driver install can fail in ctypes before NVML answers
            return self._off(f"{type(exc).__name__}: {exc}")
        self.available = True
        return True

    def _off(self, why: str) -> bool:
        self.log.info("no NVML (%s): GPU metrics off, CPU figures only", why)
        self.available = False
        return False

    def _once(self, index: int, what: str, exc: BaseException) -> None:
        # A lost GPU fails every second; one line per distinct message keeps the log readable.
        msg = f"gpu{index} {what}: {type(exc).__name__}: {exc}"
        if msg not in self._logged:
            self._logged.add(msg)
            self.log.warning("NVML: %s", msg)

    def _handle(self, index: int) -> Any:
        # Handles are stable for the life of an NVML session: fetch each one once.
        handle = self._handles.get(index)
        if handle is None:
            handle = self._handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(index)
        return handle

    def device_count(self) -> int:
        return self._count if self.available else 0

    def devices(self) -> list[dict[str, Any]]:
        """One dict per readable device: index, name, uuid, mem_used, mem_total, util_gpu."""
        if not self.available:
            return []
        err = self._nvml_error()
        out = []
        for i in range(self._count):
            try:
                h = self._handle(i)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
                row = {
                    "index": i,
                    "name": _text(self.nvml.nvmlDeviceGetName(h)),
                    "uuid": _text(self.nvml.nvmlDeviceGetUUID(h)),
                    "mem_used": int(mem.used),
                    "mem_total": int(mem.total),
                    "util_gpu": None,
                }
            except err as exc:
                self._once(i, "device query failed", exc)
                continue
            try:
                # Some devices (MIG slices, a few datacenter modes) do not report utilisation:
                # memory figures are still worth having.
                row["util_gpu"] = int(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except err as exc:
                self._once(i, "utilization unavailable", exc)
            out.append(row)
        return out

    def process_gpu_memory(self) -> dict[int, int]:
        """pid -> bytes of GPU memory, summed over devices (compute + graphics contexts)."""
        if not self.available:
            return {}
        err = self._nvml_error()
        total: dict[int, int] = {}
        for i in range(self._count):
            per_device: dict[int, int] = {}
            for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                fn = getattr(self.nvml, fn_name, None)
                if fn is None:
                    continue
                try:
                    procs = fn(self._handle(i))
                except err as exc:
                    self._once(i, fn_name.removeprefix("nvmlDeviceGet"), exc)
                    break  # a lost device fails both lists: one line says it
                for p in procs:
                    used = int(p.usedGpuMemory or 0)
                    # A process with both a compute and a graphics context ("C+G") is listed
                    # twice with the same figure: count it once per device, as nvidia-smi does.
                    per_device[p.pid] = max(per_device.get(p.pid, 0), used)
            for pid, used in per_device.items():
                total[pid] = total.get(pid, 0) + used
        return total

    def shutdown(self) -> None:
        if self.available:
            self.available = False
            self._handles.clear()
            try:
                self.nvml.nvmlShutdown()
            except self._nvml_error() as exc:
                self.log.info("NVML shutdown: %s", exc)


def _text(value: Any) -> str:
    # Old pynvml releases return bytes for names and UUIDs.
    return value.decode() if isinstance(value, bytes) else str(value)
