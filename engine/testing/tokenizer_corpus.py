"""The byte-level BPE tokenizer of generated test models: training code and corpus.

`train_tokenizer(arch, vocab_size)` trains a `tokenizers` BPE (256-byte initial alphabet,
ByteLevel pre-tokenizer and decoder) on `CORPUS_TEXT`, an embedded text written for this
project. The corpus mixes English prose, code and numbers with accented Latin, Greek,
Cyrillic, CJK, Korean, Arabic, Hindi and emoji, so a small vocabulary keeps tokens that
are partial UTF-8 sequences (a lone lead byte of a CJK character, half an emoji) next to
whole-character and whole-word tokens. Training is deterministic (checked across
processes): the same arguments give an identical tokenizer.json. Changing this file
changes every generated tokenizer and the cached models' directory names.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

# Qwen2's pre-tokenizer split (as in its tokenizer.json and transformers' Qwen2Tokenizer).
_QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _new_tokenizer(arch: str) -> Tokenizer:
    """An untrained byte-level BPE with the arch family's normalizer and pre-tokenizer.

    qwen2/qwen3 copy Qwen2's pipeline (NFC, Qwen's split regex, ByteLevel without regex):
    transformers rebuilds that pipeline for qwen2 checkpoints whatever tokenizer.json
    says, so matching it keeps HF and tokenizer.json in agreement. llama/mistral use
    GPT-2's ByteLevel regex and no normalizer.
    """
    tokenizer = Tokenizer(models.BPE())
    if arch.startswith("qwen"):
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(arch: str, vocab_size: int, text: str | None = None) -> Tokenizer:
    """A BPE of at most `vocab_size` tokens trained on `text` (default CORPUS_TEXT), with
    arch's pipeline.

    Specials: <pad> = 0, <s> = 1 (bos), </s> = 2 (eos). llama/mistral prepend <s> at
    encode time; qwen2/qwen3 add nothing. The corpus may support fewer merges than asked.
    """
    tokenizer = _new_tokenizer(arch)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS_TEXT if text is None else text], trainer=trainer)
    ids = [tokenizer.token_to_id(t) for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)]
    assert ids == [PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID], ids
    _set_post_processor(tokenizer, arch)
    return tokenizer


def _set_post_processor(tokenizer: Tokenizer, arch: str) -> None:
    """llama/mistral prepend `<s>` at encode time; qwen2/qwen3 add nothing."""
    if arch in ("llama", "mistral"):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)


def tokenizer_config(arch: str, model_max_length: int) -> dict[str, Any]:
    """Contents of tokenizer_config.json for a tokenizer from `train_tokenizer(arch, ...)`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": arch in ("llama", "mistral"),
        "add_eos_token": False,
        "unk_token": None,  # else transformers' Qwen2Tokenizer adds <|endoftext|> as unk
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


CORPUS_TEXT = """\
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun.
A server receives a request, splits the prompt into tokens, and returns a stream of text.
The prefill worker reads the whole prompt at once; the decode worker writes one token at a time.
When the cache is full, the scheduler waits, evicts an old block, or preempts a request.
Every block holds sixteen tokens. Every token has an id, a position and a place in the cache.
She said: "It is raining again, so we will stay home and read." He said: "Then I will cook."
On Monday the weather was cold; on Tuesday it was colder; by Friday the river had frozen.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536.
Prices rose by 3.5% in 2023 and by 2.75% in 2024; the total was $1,234.56 (about €1,140).
Call me at 555-0199 before 10:30 a.m., or write to team@example.org with the subject "KV".
The model has 8 layers, 8 heads, 2 key/value heads, and a hidden size of 512 numbers.
Questions? Answers! Lists: apples, pears, plums; tools -- a hammer, a saw, a drill...

def generate(prompt, max_tokens=32, temperature=0.0):
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)[-1]
        next_id = int(logits.argmax())
        if next_id == eos_token_id:
            break
        tokens.append(next_id)
    return tokenizer.decode(tokens)

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product
SELECT id, name FROM workers WHERE role = 'decode' AND free_blocks > 100;
{"request_id": "r-17", "max_tokens": 64, "stop": ["\\n\\n", "END"], "top_p": 0.9}
\tTabs\tand  double  spaces   and    more     spaces\r\nand a carriage return.

Français : Le café est très chaud, mais la crème brûlée est déjà froide. Où est la gare ?
L'été dernier, nous avons visité un château près de la mer ; c'était une journée magnifique.
Les élèves écrivent leurs leçons à la bibliothèque, où règne un silence presque complet.
Deutsch: Die Straße ist naß, die Bäume sind grün, und über dem Fluß fliegen fünf Vögel.
Größere Schlüssel öffnen schwere Türen; kleine Mädchen spielen fröhlich im Garten hinter dem Haus.
Español: El niño comió una manzana, y la señora mañana viajará a Córdoba en un tren rápido.
¿Dónde está la estación? ¡Qué día tan bonito! La canción del corazón suena otra vez.
Português: A informação é útil; não há razão para pressa, e a situação está sob controle.
Ação, emoção, coração, canção: as palavras terminadas em ção são muito comuns em português.
Polski: Zażółć gęślą jaźń. Źródło wody jest czyste, a łąka pełna kwiatów i pszczół.
Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy. Řeka teče pod mostem ve městě.
Tiếng Việt: Tôi yêu tiếng Việt; mỗi ngày tôi học một chút và viết những câu ngắn.
Türkçe: Güzel bir gün; çocuklar bahçede oynuyor, kediler güneşte uyuyor ve kuşlar şarkı söylüyor.
Íslenska: Þetta er ágætt; ég fór út í góða veðrinu og sá hvali við ströndina.
Dansk og norsk: Æbler og blåbær på bordet; søster går til skolen i morgen tidlig.

Ελληνικά: Καλημέρα σας! Η θάλασσα είναι ήρεμη σήμερα και ο ουρανός είναι γαλάζιος.
Το παιδί διαβάζει ένα βιβλίο στη βιβλιοθήκη, ενώ η μητέρα του μαγειρεύει στην κουζίνα.
Μαθηματικά: α + β = γ, π ≈ 3.14159, και η συνάρτηση λ(x) = x² + 1 είναι πάντα θετική.
Ο χρόνος περνά γρήγορα όταν διαβάζουμε ιστορίες για θεούς, ήρωες και μακρινά ταξίδια.

Русский: Привет, мир! Сегодня хорошая погода, и мы идём гулять в парк у реки.
Быстрая коричневая лиса прыгает через ленивую собаку, а кошка спит на тёплом окне.
Мы читаем книги, пишем письма и слушаем музыку; зимой здесь очень холодно и тихо.
Українська: Добрий день! Ця пісня про рідний край, про поле, річку і зелений ліс.
Їжак їсть яблуко, а ґава сидить на гілці біля старої хати в селі.
Български: Здравейте! Днес е слънчево и ние ще ходим на разходка в планината.

中文：今天天气很好，我们一起去公园散步吧。人工智能正在改变世界。
我喜欢读书，也喜欢写字。这个模型很小，但是它可以生成文字。
服务器接收请求，把提示分成词元，然后一个一个地生成新的词元。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
北京、上海、广州和深圳都是很大的城市，每天都有很多人坐地铁上班。
日本語：今日はいい天気ですね。私は毎朝コーヒーを飲みます。
東京の駅はとても大きくて、電車がたくさん走っています。ありがとうございます。
ひらがな、カタカナ、そして漢字を使って、日本語の文章を書きます。
한국어: 안녕하세요! 오늘은 날씨가 좋아서 친구와 함께 공원에 갔습니다.
저는 한국 음식을 좋아합니다. 김치와 비빔밥은 정말 맛있어요.

العربية: مرحبا بالعالم. الطقس جميل اليوم، ونحن نذهب إلى السوق في الصباح.
עברית: שלום עולם! היום יום יפה ואנחנו הולכים לים.
हिन्दी: नमस्ते दुनिया! आज मौसम बहुत अच्छा है और हम बाज़ार जा रहे हैं।
ไทย: สวัสดีครับ วันนี้อากาศดีมาก เราจะไปเที่ยวทะเลกัน

Emoji: 😀 😃 😄 😁 😂 🤣 😊 🙂 🙃 😉 😍 🥰 😘 🤔 🤖 👍 👎 👋 🙏 🔥 ✨ 🎉 🚀 🌍 🌈 ☕ 🍕 🍣 🐍 🦀
Families and flags: 👨‍👩‍👧‍👦 👩‍💻 🧑‍🚀 🏳️‍🌈 🇫🇷 🇩🇪 🇯🇵 🇺🇸 👍🏽 👋🏿 ❤️ ✔️
Great job! 🎉🎉 The build is green ✅, the tests pass 👍, and the deploy is on its way 🚀.
I love pizza 🍕 and sushi 🍣; my cat 🐈 loves fish 🐟; the weather is sunny ☀️ today.
Symbols: → ← ↑ ↓ ⇒ ∀ ∃ ∈ ∉ ∑ ∏ √ ∞ ≤ ≥ ≠ ± × ÷ ° © ® ™ § ¶ • … « » „ “ ” ‘ ’ — –
Math: ∫₀¹ x² dx = ⅓; e^(iπ) + 1 = 0; ‖v‖₂ ≤ √n · max|vᵢ|; ℝ, ℕ, ℤ, ℚ, ℂ.
Currency: € £ ¥ ₹ ₽ ₩ ₿ $ ¢; temperature 21 °C (70 °F); distance 5 km ≈ 3.1 mi.

The tokenizer splits text into bytes and merges frequent pairs of bytes into larger tokens.
Common words like the, and, of, to, in, is, that, it, for, on, with, as, was become single tokens.
Rare characters such as 龘, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, or 🦩 stay split into several byte tokens.
A long sentence can contain many different words, and a short one can contain just a few.
Requests arrive, wait in a queue, run in a batch, finish with a stop token, and leave.
Decode is memory bound: each step reads the weights and the cache of every running sequence.
Prefill is compute bound: it multiplies large matrices for all prompt tokens at once.
The router chooses a prefill worker by prefix affinity and a decode worker by free blocks.
When a worker dies, the router notices the missing heartbeat and sends new work elsewhere.
Let us repeat: the cache, the block, the token, the batch, the worker, the router, the model.
"""
