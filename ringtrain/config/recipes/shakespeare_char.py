"""nanoGPT's config/train_shakespeare_char.py: a baby GPT on Shakespeare's characters (GPU).

    ringtrain train --recipe shakespeare_char --data input.txt --nproc-per-node 1

Values and reasons are nanoGPT's (its comments quoted); what nanoGPT's train.py leaves at its
defaults and ours differ on is set here too, so the model and optimizer are the same. Not
matched: nanoGPT scores 200 random eval batches, we score the whole held-out split.
"""

eval_every = 250  # "keep frequent because we'll overfit"
log_every = 10  # "don't print too too often"

batch_size = 64
block_size = 256  # "context of up to 256 previous characters"
grad_accum = 1

# "baby GPT model :)"
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
bias = False  # nanoGPT's train.py default: no biases in Linear and LayerNorm
tie_embeddings = True  # nanoGPT always ties the token embedding to the output layer

lr = 1e-3  # "with baby networks can afford to go a bit higher"
steps = 5000  # max_iters = lr_decay_iters: the cosine ends at the last step, as ours does
min_lr = 1e-4  # "learning_rate / 10 usually"
beta2 = 0.99  # "make a bit bigger because number of tokens per iter is small"
warmup_steps = 100  # "not super necessary potentially"
