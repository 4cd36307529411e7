"""Native mixtures of experts for Pagoda: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, served by the
``native`` model impl on the core's fused MoE operator (``pagoda.ops.fused_experts``)."""
