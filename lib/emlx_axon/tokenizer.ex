defmodule EMLXAxon.Tokenizer do
  @moduledoc """
  A Hugging Face tokenizer (`tokenizer.json`) with its chat template,
  running natively (the Rust `tokenizers` crate and a Jinja engine).

  A checkpoint directory such as the ones published by `mlx-community`
  holds everything: `tokenizer.json`, `tokenizer_config.json` (special
  tokens and the chat template) and `generation_config.json` (the EOS
  tokens the model was trained to stop on).

  ## Examples

      {:ok, tokenizer} = EMLXAxon.Tokenizer.load("~/models/Qwen3-0.6B-MLX-4bit")
      {:ok, ids} = EMLXAxon.Tokenizer.encode(tokenizer, "Hello world")
      {:ok, "Hello world"} = EMLXAxon.Tokenizer.decode(tokenizer, ids)

      {:ok, prompt} =
        EMLXAxon.Tokenizer.apply_chat_template(tokenizer, [%{role: "user", content: "Hi!"}])

  A tokenizer can be shared freely between processes.
  """

  alias EMLXAxon.{Error, Native, Options}

  @encode_schema [
    add_special_tokens: [
      type: :boolean,
      default: false,
      doc:
        "add the tokenizer's special tokens (such as a BOS token) around the text " <>
          "(Qwen tokenizers add none)"
    ]
  ]

  @decode_schema [
    skip_special_tokens: [
      type: :boolean,
      default: true,
      doc: "leave special tokens such as `<|im_end|>` out of the text"
    ]
  ]

  @chat_schema [
    add_generation_prompt: [
      type: :boolean,
      default: true,
      doc: "end with the assistant turn's header so the model answers"
    ],
    enable_thinking: [
      type: {:or, [:boolean, nil]},
      default: nil,
      doc:
        "Qwen3's switch for the thinking block: `false` renders an empty " <>
          "`<think></think>` so the model answers directly; `nil` leaves the template's " <>
          "own default"
    ],
    tools:
      Options.tools_spec(
        "functions the model may call, as transformers takes them, rendered by the " <>
          "template (Qwen's lists them in the system turn and asks for `<tool_call>` answers)"
      )
  ]

  @enforce_keys [:ref, :path]
  defstruct [:ref, :path, :vocab_size]

  @typedoc """
  A loaded tokenizer; `:path` is where it was loaded from and `:vocab_size`
  the number of tokens it knows (special tokens included).
  """
  @type t :: %__MODULE__{ref: reference(), path: String.t(), vocab_size: pos_integer()}

  @typedoc """
  A chat message: `%{role: role, content: content}` (atom or string keys)
  or a `{role, content}` tuple. Roles are strings or atoms such as `:user`.
  """
  @type message ::
          %{required(:role) => String.t() | atom(), required(:content) => String.t()}
          | %{required(String.t()) => String.t()}
          | {String.t() | atom(), String.t()}

  @doc """
  Loads a tokenizer from a checkpoint directory (or `{:local, dir}`), from
  the path of a `tokenizer.json` file, or from the Hugging Face Hub as
  `{:hf, repo}` or `{:hf, repo, options}` (only the tokenizer's files are
  downloaded: see `EMLXAxon.Hub`).

  Returns `{:error, %EMLXAxon.Error{}}` when the files are missing or
  malformed.

  ## Examples

      {:ok, tokenizer} = EMLXAxon.Tokenizer.load("~/models/Qwen3-0.6B-MLX-4bit")
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load({:local, "/models/qwen3/tokenizer.json"})
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load({:hf, "mlx-community/Qwen3-0.6B-4bit"})
      {:error, %EMLXAxon.Error{kind: :io}} = EMLXAxon.Tokenizer.load("/nowhere")

  """
  @spec load(Path.t() | {:local, Path.t()} | EMLXAxon.Hub.repository()) ::
          {:ok, t()} | {:error, Error.t()}
  def load({:local, path}), do: load(path)

  def load({:hf, _} = repository), do: load_hub(repository)
  def load({:hf, _, _} = repository), do: load_hub(repository)

  def load(path) when is_binary(path) do
    path = Path.expand(path)

    if File.exists?(path) do
      with {:ok, ref} <- Error.wrap(Native.tokenizer_load(path)),
           {:ok, %{vocab_size: vocab_size}} <- Error.wrap(Native.tokenizer_info(ref)) do
        {:ok, %__MODULE__{ref: ref, path: path, vocab_size: vocab_size}}
      end
    else
      {:error, %Error{kind: :io, message: "tokenizer path does not exist: #{path}"}}
    end
  end

  def load(other) do
    raise ArgumentError,
          "expected a path (string), {:local, path} or {:hf, repo} to load a tokenizer from, " <>
            "got: #{inspect(other)}"
  end

  defp load_hub(repository) do
    with {:ok, dir} <- EMLXAxon.Hub.fetch(repository, :tokenizer), do: load(dir)
  end

  @doc """
  Like `load/1`, but raises `EMLXAxon.Error` on failure.

  ## Examples

      tokenizer = EMLXAxon.Tokenizer.load!("~/models/Qwen3-0.6B-MLX-4bit")

  """
  @spec load!(Path.t() | {:local, Path.t()} | EMLXAxon.Hub.repository()) :: t()
  def load!(path) do
    case load(path) do
      {:ok, tokenizer} -> tokenizer
      {:error, error} -> raise error
    end
  end

  @doc """
  Encodes `text` into token ids.

  ## Options

  #{Options.docs(@encode_schema)}

  ## Examples

      {:ok, [9707, 1879]} = EMLXAxon.Tokenizer.encode(tokenizer, "Hello world")

  """
  @spec encode(t(), String.t(), keyword()) :: {:ok, [non_neg_integer()]} | {:error, Error.t()}
  def encode(%__MODULE__{ref: ref}, text, opts \\ []) do
    opts = Options.validate!(opts, @encode_schema, "EMLXAxon.Tokenizer.encode/3")

    unless is_binary(text) do
      raise ArgumentError, "expected the text to encode to be a string, got: #{inspect(text)}"
    end

    unless String.valid?(text) do
      raise ArgumentError, "expected the text to encode to be valid UTF-8, got: #{inspect(text)}"
    end

    Error.wrap(Native.tokenizer_encode(ref, text, opts[:add_special_tokens]))
  end

  @doc """
  Decodes token ids into text.

  ## Options

  #{Options.docs(@decode_schema)}

  ## Examples

      {:ok, "Hello world"} = EMLXAxon.Tokenizer.decode(tokenizer, [9707, 1879])

  """
  @spec decode(t(), [non_neg_integer()], keyword()) :: {:ok, String.t()} | {:error, Error.t()}
  def decode(%__MODULE__{ref: ref}, ids, opts \\ []) do
    opts = Options.validate!(opts, @decode_schema, "EMLXAxon.Tokenizer.decode/3")

    unless is_list(ids) and Enum.all?(ids, &(is_integer(&1) and &1 >= 0)) do
      raise ArgumentError, "expected a list of non-negative token ids, got: #{inspect(ids)}"
    end

    Error.wrap(Native.tokenizer_decode(ref, ids, opts[:skip_special_tokens]))
  end

  @doc """
  Renders chat `messages` with the tokenizer's chat template (from
  `tokenizer_config.json`), giving the prompt text to encode.

  Messages are maps with `:role` and `:content` (atom or string keys) or
  `{role, content}` tuples. An assistant message may carry `:tool_calls`
  (`[%{name: name, arguments: %{...}}]`, as `EMLXAxon.ToolCalls.parse/1`
  gives them) instead of content, and a `"tool"` message gives a call's
  result as its content.

  ## Options

  #{Options.docs(@chat_schema)}

  ## Examples

      {:ok, prompt} =
        EMLXAxon.Tokenizer.apply_chat_template(tokenizer, [
          %{role: "system", content: "You are terse."},
          %{role: "user", content: "Name a colour."}
        ])

      {:ok, prompt} =
        EMLXAxon.Tokenizer.apply_chat_template(tokenizer, [{:user, "Hi"}], enable_thinking: false)

  """
  @spec apply_chat_template(t(), [message()], keyword()) ::
          {:ok, String.t()} | {:error, Error.t()}
  def apply_chat_template(%__MODULE__{ref: ref}, messages, opts \\ []) do
    opts = Options.validate!(opts, @chat_schema, "EMLXAxon.Tokenizer.apply_chat_template/3")

    messages =
      messages
      |> normalize_messages!()
      |> Enum.map(fn
        {role, content} -> %{"role" => role, "content" => content}
        message -> message
      end)

    Error.wrap(
      Native.tokenizer_apply_chat_template(
        ref,
        EMLXAxon.JSON.encode!(messages),
        tools!(opts[:tools]),
        opts[:add_generation_prompt],
        opts[:enable_thinking]
      )
    )
  end

  @doc """
  Returns information about the tokenizer: `:vocab_size`, `:eos_token_ids`
  (from `generation_config.json` and `tokenizer_config.json`) and
  `:has_chat_template`.

  ## Examples

      {:ok, %{vocab_size: 151_669, eos_token_ids: [151_645, 151_643], has_chat_template: true}} =
        EMLXAxon.Tokenizer.info(tokenizer)

  """
  @spec info(t()) ::
          {:ok,
           %{
             vocab_size: pos_integer(),
             eos_token_ids: [non_neg_integer()],
             has_chat_template: boolean()
           }}
          | {:error, Error.t()}
  def info(%__MODULE__{ref: ref}), do: Error.wrap(Native.tokenizer_info(ref))

  # Checked by the schema.
  defp tools!(nil), do: nil
  defp tools!(tools), do: EMLXAxon.JSON.encode!(tools)

  @doc false
  # Validates and normalizes chat messages into `[{role, content}]`, or
  # string-keyed maps for messages with tool calls.
  @spec normalize_messages!(term()) :: [{String.t(), String.t()} | map()]
  def normalize_messages!([_ | _] = messages), do: Enum.map(messages, &normalize_message!/1)

  def normalize_messages!(other) do
    raise ArgumentError,
          "expected a non-empty list of chat messages (%{role: ..., content: ...}), got: #{inspect(other)}"
  end

  @doc false
  # True for a term that looks like a single chat message.
  @spec message?(term()) :: boolean()
  def message?(%{role: _, content: _}), do: true
  def message?(%{"role" => _, "content" => _}), do: true
  def message?(%{role: _, tool_calls: _}), do: true
  def message?(%{"role" => _, "tool_calls" => _}), do: true

  def message?({role, content}) when (is_binary(role) or is_atom(role)) and is_binary(content),
    do: true

  def message?(_), do: false

  defp normalize_message!(%{role: _, tool_calls: _} = m), do: tool_call_message!(m)
  defp normalize_message!(%{"role" => _, "tool_calls" => _} = m), do: tool_call_message!(m)
  defp normalize_message!(%{role: role, content: content}), do: message!(role, content)
  defp normalize_message!(%{"role" => role, "content" => content}), do: message!(role, content)
  defp normalize_message!({role, content}), do: message!(role, content)

  defp normalize_message!(other) do
    raise ArgumentError,
          "expected a chat message as %{role: role, content: content} or {role, content}, " <>
            "got: #{inspect(other)}"
  end

  defp tool_call_message!(message) do
    message = Map.new(message, fn {key, value} -> {to_string(key), value} end)
    content = message["content"]

    {role, _} = message!(message["role"], if(is_binary(content), do: content, else: ""))

    unless is_list(message["tool_calls"]) and Enum.all?(message["tool_calls"], &is_map/1) and
             (content == nil or is_binary(content)) do
      raise ArgumentError,
            "expected a message's :tool_calls to be a list of maps (and its content a " <>
              "string or nil), got: #{inspect(message)}"
    end

    Map.put(message, "role", role)
  end

  defp message!(role, content) when is_atom(role) and not is_nil(role) and not is_boolean(role),
    do: message!(Atom.to_string(role), content)

  defp message!(role, content) when is_binary(role) and is_binary(content) do
    unless String.valid?(role) and String.valid?(content) do
      raise ArgumentError,
            "expected a chat message's role and content to be valid UTF-8, " <>
              "got role #{inspect(role)} and content #{inspect(content)}"
    end

    {role, content}
  end

  defp message!(role, content) do
    raise ArgumentError,
          "expected a chat message's role to be a string or atom and its content a string, " <>
            "got role #{inspect(role)} and content #{inspect(content)}"
  end
end
