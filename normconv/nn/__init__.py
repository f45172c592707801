"""The modules normconv inserts into a rewritten model: a fast RMSNorm (rmsnorm), Float32Norm, ChannelShift and
the DeepNorm hooks (modules)."""
