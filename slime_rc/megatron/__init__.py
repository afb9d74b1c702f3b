"""slime-rc inside Megatron: vocab-parallel log-probs, the policy loss ``loss_func`` for
``get_forward_backward_func()``, and the CPU patches that let real megatron-core run on gloo (tests, laptops)."""
