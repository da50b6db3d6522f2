"""The largest storage buffer each Vulkan device lets one shader address.

llama.cpp's Vulkan backend runs an op on the CPU when one of its tensors is larger than the
device's ``maxStorageBufferRange`` (ggml-vulkan ``supports_op``): on Mesa's lavapipe that is
128 MiB, less than a 1024-token ubatch of logits for a 49k-token vocabulary, so the output
layer is computed in host memory there. ggml does not expose the limit; it is read here from
the Vulkan loader with ctypes (vkGetPhysicalDeviceProperties), by device name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
# VkPhysicalDeviceProperties: five uint32 fields, deviceName[256], pipelineCacheUUID[16], then
# VkPhysicalDeviceLimits (8-byte aligned: it holds VkDeviceSize fields), whose eighth uint32 is
# maxStorageBufferRange
_NAME_OFFSET = 20
_LIMITS_OFFSET = 296
_MAX_STORAGE_BUFFER_RANGE = _LIMITS_OFFSET + 7 * 4
_PROPERTIES_SIZE = 4096  # larger than the struct (824 bytes in Vulkan 1.x)


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.c_void_p),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


@functools.cache
def storage_buffer_ranges() -> dict[str, int]:
    """``maxStorageBufferRange`` by device name (``llvmpipe (LLVM 15.0.6, 256 bits)``); empty
    without a Vulkan loader or device."""
    name = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    try:
        vk = ctypes.CDLL(name)
    except OSError:
        return {}
    vk.vkCreateInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    vk.vkEnumeratePhysicalDevices.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p
    ]  # fmt: skip
    vk.vkGetPhysicalDeviceProperties.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    vk.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    info = _InstanceCreateInfo(sType=_VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return {}
    try:
        count = ctypes.c_uint32(0)
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != 0:
            return {}
        handles = (ctypes.c_void_p * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles) not in (0, 5):
            return {}
        out: dict[str, int] = {}
        for handle in handles[: count.value]:
            props = ctypes.create_string_buffer(_PROPERTIES_SIZE)
            vk.vkGetPhysicalDeviceProperties(handle, props)
            raw = props.raw
            device = raw[_NAME_OFFSET : _NAME_OFFSET + 256].split(b"\0", 1)[0].decode()
            limit = int.from_bytes(
                raw[_MAX_STORAGE_BUFFER_RANGE : _MAX_STORAGE_BUFFER_RANGE + 4], "little"
            )
            out[device] = limit
        return out
    finally:
        vk.vkDestroyInstance(instance, None)
