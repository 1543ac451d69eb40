def inject(layout: int, layers: int, heads: int, dim: int, rot: int, block_size: int,
           tokens: int, piece_k: int, piece_v: int, layer_stride: int, bits: int, fp8: int,
           k_params: int, v_params: int, v_params_stride: int, slots: int, groups: int,
           positions: int, cos_sin: int, layer_rows: int, scales: int, caches: int,
           /) -> None: ...
