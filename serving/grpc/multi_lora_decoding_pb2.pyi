# fmt: off
# ruff: noqa
# Generated from multi_lora_decoding.proto by `python -m serving.grpc.generate`.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("success", "error_message", "adapter_infos")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_message: str
    adapter_infos: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, success: _Optional[bool] = ..., error_message: _Optional[str] = ..., adapter_infos: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("adapter_id", "loading_cost", "size_hbm", "size_cpu", "last_accessed", "status")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    LOADING_COST_FIELD_NUMBER: _ClassVar[int]
    SIZE_HBM_FIELD_NUMBER: _ClassVar[int]
    SIZE_CPU_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESSED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    loading_cost: int
    size_hbm: int
    size_cpu: int
    last_accessed: float
    status: str
    def __init__(self, adapter_id: _Optional[str] = ..., loading_cost: _Optional[int] = ..., size_hbm: _Optional[int] = ..., size_cpu: _Optional[int] = ..., last_accessed: _Optional[float] = ..., status: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "adapter_path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    adapter_path: str
    def __init__(self, adapter_id: _Optional[str] = ..., adapter_path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("success", "error_message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_message: str
    def __init__(self, success: _Optional[bool] = ..., error_message: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    def __init__(self, adapter_id: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("success", "error_message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_message: str
    def __init__(self, success: _Optional[bool] = ..., error_message: _Optional[str] = ...) -> None: ...
