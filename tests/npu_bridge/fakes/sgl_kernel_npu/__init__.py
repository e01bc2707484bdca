"""FAKE sgl_kernel_npu package (mocked-contract tier)."""

import fake_log

fake_log.record("import", module="sgl_kernel_npu")
