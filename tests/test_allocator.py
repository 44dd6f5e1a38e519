"""The host allocator tuning is accepted by glibc (a no-op returning False elsewhere)."""

import platform

from engine.allocator import keep_freed_memory


def test_keep_freed_memory_is_accepted_on_glibc():
    result = keep_freed_memory()
    if platform.libc_ver()[0] == "glibc":
        assert result is True
    else:
        assert result is False
