"""The run time: the fused custom ops, their dispatch to a Helion kernel or the reference, the token
router and the self-check. It imports the kernels; nothing on the compile side imports it."""
