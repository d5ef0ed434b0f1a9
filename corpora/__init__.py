"""What the federation is trained on: corpus loaders (PTB, WikiText-2, user text, Stack Exchange),
the embedded demo corpus, the partition into the phones' private shards, and the server's side
(tokenizer text, held-out sets). Both the server and the phones read it; it imports neither."""
