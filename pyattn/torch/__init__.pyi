"""Type stubs of pyattn.torch (the implementation is __init__.py and _bridge.py): pyattn's
signatures, with torch tensors where pyattn takes and returns arrays."""
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, overload

from torch import Tensor

from ..feature_maps import Kind

# a tensor, or what pyattn also takes where it takes an array (a Python number, a list)
_TensorLike = Union[Tensor, float, Sequence[float], Sequence[int]]
_Form = Literal["chunk", "parallel", "recurrent"]
_ChunkSize = Literal[16, 32, 64, 128]
_WithState = Tuple[Tensor, Optional[Tensor]]

__all__: List[str]


def attention_with_kvcache(
    q: _TensorLike, k_cache: Tensor, v_cache: Tensor, cache_seqlens: _TensorLike, *,
    k: Optional[_TensorLike] = ..., v: Optional[_TensorLike] = ..., causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], Tensor]] = ...,
    sinks: int = ..., alibi_slopes: Optional[_TensorLike] = ..., softcap: float = ...,
    block_table: Optional[_TensorLike] = ..., num_splits: int = ..., return_lse: bool = ...,
    return_colsum: bool = ...,
) -> Union[Tensor, Tuple[Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]]:
    """o; (o, lse) with return_lse; colsum [B, H, capacity] appended with return_colsum."""

def delta_rule(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, beta: _TensorLike, *,
    qk_l2norm: bool = ..., scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def dsa_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, index_q: _TensorLike,
    index_k: _TensorLike, index_w: _TensorLike, *, top_k: int, causal: bool = ...,
    scale: Optional[float] = ..., cu_seqlens: Optional[_TensorLike] = ...,
) -> Tensor: ...

def dsa_index_scores(
    index_q: _TensorLike, index_k: _TensorLike, index_w: _TensorLike,
) -> Tensor: ...

def dsa_index_target(
    q: _TensorLike, k: _TensorLike, *, causal: bool = ..., scale: Optional[float] = ...,
    indices: Optional[_TensorLike] = ..., cu_seqlens: Optional[_TensorLike] = ...,
) -> Tensor: ...

def dsa_select(
    index_q: _TensorLike, index_k: _TensorLike, index_w: _TensorLike, *, top_k: int,
    causal: bool = ..., cu_seqlens: Optional[_TensorLike] = ...,
) -> Tensor: ...

def efficient_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, scale: Optional[float] = ...,
    cu_seqlens: Optional[_TensorLike] = ..., form: Literal["parallel"] = ...,
) -> Tensor: ...

def feature_map(x: _TensorLike, kind: Kind, *, p: int = ..., projection: _TensorLike = ...,
                max_len: float = ...) -> Tensor: ...

def forgetting_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, *, window: Optional[int] = ...,
    scale: Optional[float] = ..., cu_seqlens: Optional[_TensorLike] = ...,
    form: Literal["flash", "parallel"] = ...,
) -> Tensor: ...

def gated_delta_rule(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, beta: _TensorLike, *,
    qk_l2norm: bool = ..., scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def gated_delta_product(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: Optional[_TensorLike], beta: _TensorLike, *,
    num_householder: int, qk_l2norm: bool = ..., scale: Optional[float] = ...,
    initial_state: Optional[_TensorLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def rwkv6(
    r: _TensorLike, k: _TensorLike, v: _TensorLike, w: _TensorLike, u: _TensorLike, *,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def dplr_delta_rule(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, a: _TensorLike, b: _TensorLike,
    gk: _TensorLike, *, scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ...,
    form: Literal["recurrent"] = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def rwkv7(
    r: _TensorLike, w: _TensorLike, k: _TensorLike, v: _TensorLike, a: _TensorLike,
    b: _TensorLike, *, scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ...,
    form: Literal["recurrent"] = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def log_linear_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, level_scales: _TensorLike, *,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ...,
    form: Literal["chunk", "recurrent", "parallel"] = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def gla(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, *,
    gv: Optional[_TensorLike] = ..., scale: Optional[float] = ...,
    initial_state: Optional[_TensorLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def kda(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, beta: _TensorLike, *,
    qk_l2norm: bool = ..., scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def lightning_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, slopes: Optional[_TensorLike] = ...,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def linear_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, feature_map: Optional[Kind] = ...,
    feature_map_params: Optional[Dict[str, Any]] = ..., normalize: bool = ..., eps: float = ...,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def linformer_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, E: _TensorLike, F: _TensorLike, *,
    scale: Optional[float] = ...,
) -> Tensor: ...

def mamba2(
    x: _TensorLike, dt: _TensorLike, A: _TensorLike, B: _TensorLike, C: _TensorLike, *,
    D: Optional[_TensorLike] = ..., dt_bias: Optional[_TensorLike] = ..., dt_softplus: bool = ...,
    initial_state: Optional[_TensorLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def merge_attention_states(
    os: Sequence[_TensorLike], lses: Sequence[_TensorLike]
) -> Tuple[Tensor, Tensor]: ...

def mla_attention(
    q_nope: _TensorLike, q_rope: _TensorLike, c_kv: _TensorLike, k_rope: _TensorLike,
    w_uk: _TensorLike, w_uv: _TensorLike, *, causal: bool = ..., scale: Optional[float] = ...,
    form: Literal["naive", "absorbed"] = ...,
) -> Tensor: ...

def moba_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, block_size: int, top_k: int,
    causal: bool = ..., scale: Optional[float] = ..., cu_seqlens: Optional[_TensorLike] = ...,
) -> Tensor: ...

def nsa_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g_cmp: _TensorLike, g_slc: _TensorLike,
    g_swa: _TensorLike, *, block_size: int = ..., block_count: int = ..., window: int = ...,
    k_cmp: Optional[_TensorLike] = ..., v_cmp: Optional[_TensorLike] = ...,
    scale: Optional[float] = ..., cu_seqlens: Optional[_TensorLike] = ...,
) -> Tensor: ...

def retention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, gamma: Optional[_TensorLike] = ...,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

def rope(x: _TensorLike, positions: _TensorLike, theta: float = ...) -> Tensor: ...

def simple_gla(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, g: _TensorLike, *,
    scale: Optional[float] = ..., initial_state: Optional[_TensorLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[_TensorLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...

@overload
def softmax_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], Tensor]] = ...,
    sinks: int = ..., alibi_slopes: Optional[_TensorLike] = ..., softcap: float = ...,
    cu_seqlens: Optional[_TensorLike] = ..., cu_seqlens_q: Optional[_TensorLike] = ...,
    cu_seqlens_k: Optional[_TensorLike] = ...,
    form: Literal["flash", "parallel", "recurrent"] = ..., return_lse: Literal[False] = ...,
) -> Tensor: ...

@overload
def softmax_attention(
    q: _TensorLike, k: _TensorLike, v: _TensorLike, *, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], Tensor]] = ...,
    sinks: int = ..., alibi_slopes: Optional[_TensorLike] = ..., softcap: float = ...,
    cu_seqlens: Optional[_TensorLike] = ..., cu_seqlens_q: Optional[_TensorLike] = ...,
    cu_seqlens_k: Optional[_TensorLike] = ...,
    form: Literal["flash", "parallel", "recurrent"] = ..., return_lse: Literal[True],
) -> Tuple[Tensor, Tensor]: ...
