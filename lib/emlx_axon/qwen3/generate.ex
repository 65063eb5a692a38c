defmodule EMLXAxon.Qwen3.Generate do
  @moduledoc """
  Autoregressive token generation from token ids.

  The whole loop runs natively on MLX: the prompt is prefilled in one
  forward pass, then tokens are sampled and fed back, with the KV cache
  kept on the device. Elixir drives it in chunks of tokens, so a
  generation never holds a scheduler for long, can be stopped by a
  `:timeout`, and its KV cache is freed as soon as it finishes.

  Several prompts given together are decoded as one batch, each row
  stopping on its own (EOS, stop string, `:max_new_tokens` or `:max_len`).

  For text in and text out, see `EMLXAxon.TextGeneration`.

  ## Usage

      {:ok, state} = EMLXAxon.Qwen3.Loader.load(model_path)
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load(model_path)
      {:ok, input_ids} = EMLXAxon.Tokenizer.encode(tokenizer, "The capital of France is")

      {:ok, %{token_ids: ids, finish_reason: :length, timings: timings}} =
        EMLXAxon.Qwen3.Generate.generate(state, input_ids, max_new_tokens: 16)

  """

  alias EMLXAxon.{Error, Generation, Options}
  alias EMLXAxon.Qwen3.Model.State

  @defaults Options.generation_defaults() ++
              Options.constraint_defaults() ++
              [
                tokenizer: nil,
                profile_timing: false,
                stream: nil,
                timeout: :infinity,
                chunk_size: 16,
                on_chunk: nil
              ]

  @typedoc "The result of generating from one prompt."
  @type result :: %{
          token_ids: [non_neg_integer()],
          text: String.t(),
          finish_reason: :eos | :stop | :length | :max_len | :timeout,
          timings: timings()
        }

  @typedoc """
  Token counts and timings. `prompt_tokens` and `generated_tokens` are this
  prompt's; the times are the whole batch's.

  Always measured: the token counts, `batch_size` and `total_ms` (the wall
  time of the call, measured in Elixir). Measured only with
  `profile_timing: true`, and 0.0 otherwise: `prefill_ms`, `decode_ms`,
  `decode_tokens_per_s` and `time_to_first_token_ms`. Without it the engine
  takes no timestamps at all, and does not wait for the prefill to finish
  before queuing the first decode step.
  """
  @type timings :: %{
          prompt_tokens: non_neg_integer(),
          generated_tokens: non_neg_integer(),
          batch_size: pos_integer(),
          prefill_ms: float(),
          decode_ms: float(),
          decode_tokens_per_s: float(),
          time_to_first_token_ms: float(),
          total_ms: float()
        }

  @doc """
  Generates tokens following `input_ids`.

  `input_ids` is a list of token ids, or a list of such lists to decode
  several prompts as one batch (then a list of results is returned, in
  order). An `Nx.Tensor` of shape `{n}` or `{batch, n}` works too (where
  Nx is installed); a `{1, n}` tensor counts as a single prompt.

  The generated `token_ids` include the EOS token when generation stopped
  on one (`finish_reason: :eos`); `text` never includes it, nor the
  matched stop string. At least one token is always generated.

  ## Options

    * `:max_new_tokens` - the most tokens to generate (default 100);
      reaching it gives `finish_reason: :length`
    * `:max_len` - the KV cache budget: prompt plus generated tokens
      (default 2048); reaching it gives `finish_reason: :max_len`. A prompt
      that leaves no room fails with an `EMLXAxon.Error` of kind
      `:prompt_too_long`
    * `:sampler` - `:greedy` (default), `:top_p_cpu` or `:top_p_gpu`
      (nucleus sampling on the host or on the device)
    * `:temperature` - sampling temperature, >= 0; 0 decodes greedily
      (default 1.0)
    * `:top_p` - nucleus probability mass, in (0, 1] (default 0.9)
    * `:top_k` - keep only the k most likely tokens; 0 disables (default 0)
    * `:min_p` - drop tokens less likely than `min_p` times the most likely
      one; 0.0 disables (default 0.0)
    * `:seed` - seed for the sampler's random numbers; `nil` (default)
      seeds randomly
    * `:stop` - a string or list of strings ending generation
      (`finish_reason: :stop`); needs `:tokenizer`
    * `:tokenizer` - an `EMLXAxon.Tokenizer`: enables `:stop`, decodes
      `:text`, and adds the tokenizer's EOS tokens
    * `:eos_token_ids` - the tokens ending generation (default: the model's
      and the tokenizer's)
    * `:ignore_eos` - keep generating past EOS tokens (default `false`)
    * `:profile_timing` - measure the prefill and decode timings (default
      `false`; see `t:timings/0`)
    * `:stream` - the `EMLXAxon.Stream` to run on (default: the process's
      `EMLXAxon.Stream.with_stream/2` stream, else MLX's default)
    * `:timeout` - milliseconds after which unfinished rows stop with
      `finish_reason: :timeout`, checked between chunks (default `:infinity`)
    * `:chunk_size` - tokens decoded per native call (default 16)
    * `:on_chunk` - a function of one argument, called in the calling
      process after each native call with one map per prompt, in order:
      `%{ids: [integer], text: binary, finish_reason: atom | nil}` (the
      new ids and text). The first call comes after the first token alone,
      so it marks the time to first token as the caller sees it. Raising
      in it stops generation and frees its memory (default `nil`)
    * `:json_schema`, `:regex`, `:grammar` - constrain every row's output
      (needs `:tokenizer`); see "Structured output" in
      `EMLXAxon.TextGeneration`

  ## Examples

      {:ok, %{token_ids: [_ | _], finish_reason: reason}} =
        EMLXAxon.Qwen3.Generate.generate(state, [785, 6722, 315, 9625, 374], max_new_tokens: 8)

      # Two prompts decoded as one batch:
      {:ok, [first, second]} =
        EMLXAxon.Qwen3.Generate.generate(state, [[785, 6722], [9707, 11]], max_new_tokens: 8)

      # Sampling, reproducibly:
      {:ok, result} =
        EMLXAxon.Qwen3.Generate.generate(state, ids, sampler: :top_p_cpu, top_p: 0.9, seed: 42)

      {:error, %EMLXAxon.Error{kind: :prompt_too_long}} =
        EMLXAxon.Qwen3.Generate.generate(state, ids, max_len: 2)

  """
  @spec generate(State.t(), [non_neg_integer()] | [[non_neg_integer()]] | struct(), keyword()) ::
          {:ok, result() | [result()]} | {:error, Error.t()}
  def generate(state, input_ids, opts \\ [])

  def generate(%State{} = state, input_ids, opts) do
    opts = Options.validate!(opts, @defaults, "EMLXAxon.Qwen3.Generate.generate/3")
    stream = stream_option!(opts.stream)

    Options.check_stop_needs_tokenizer!(
      opts,
      opts.tokenizer,
      "EMLXAxon.Qwen3.Generate.generate/3"
    )

    {prompts, multi?} = prompts!(input_ids)
    prompts = Generation.validate_prompts!(prompts, state)
    opts = put_constraints(opts, length(prompts))

    on_chunk = on_chunk_option!(opts.on_chunk)

    with {:ok, %{rows: rows, stats: stats}} <-
           Generation.run(
             state,
             opts.tokenizer,
             EMLXAxon.Stream.resolve(stream),
             prompts,
             opts,
             on_chunk
           ) do
      results =
        rows
        |> Enum.with_index()
        |> Enum.map(fn {row, index} ->
          %{
            token_ids: row.ids,
            text: row.text,
            finish_reason: row.finish_reason,
            timings: Generation.row_timings(stats, index)
          }
        end)

      {:ok, if(multi?, do: results, else: hd(results))}
    end
  end

  def generate(state, _input_ids, _opts) do
    raise ArgumentError,
          "expected an EMLXAxon.Qwen3.Model.State (from EMLXAxon.Qwen3.Loader.load/2), " <>
            "got: #{inspect(state)}"
  end

  defp put_constraints(opts, rows) do
    case Options.constraint!(opts, "EMLXAxon.Qwen3.Generate.generate/3") do
      nil ->
        opts

      constraint ->
        if opts.tokenizer == nil do
          raise ArgumentError,
                "constrained decoding works on the tokens' text, so " <>
                  "EMLXAxon.Qwen3.Generate.generate/3 needs the :tokenizer option with it"
        end

        Map.put(opts, :row_constraints, List.duplicate(constraint, rows))
    end
  end

  defp on_chunk_option!(nil), do: nil
  defp on_chunk_option!(fun) when is_function(fun, 1), do: fun

  defp on_chunk_option!(other) do
    raise ArgumentError,
          "expected :on_chunk to be a function of one argument, got: #{inspect(other)}"
  end

  defp stream_option!(nil), do: nil
  defp stream_option!(%EMLXAxon.Stream{} = stream), do: stream

  defp stream_option!(other) do
    raise ArgumentError, "expected :stream to be an EMLXAxon.Stream, got: #{inspect(other)}"
  end

  defp prompts!(%{__struct__: Nx.Tensor} = tensor) do
    # Nx is optional: call it dynamically so this compiles without it.
    case apply(Nx, :shape, [tensor]) do
      {_n} ->
        {[apply(Nx, :to_flat_list, [tensor])], false}

      {1, _n} ->
        {apply(Nx, :to_list, [tensor]), false}

      {_batch, _n} ->
        {apply(Nx, :to_list, [tensor]), true}

      shape ->
        raise ArgumentError,
              "expected input_ids of shape {n} or {batch, n}, got: #{inspect(shape)}"
    end
  end

  defp prompts!([first | _] = prompts) when is_list(first), do: {prompts, true}
  defp prompts!([_ | _] = ids), do: {[ids], false}

  defp prompts!(other) do
    raise ArgumentError,
          "expected input_ids to be a non-empty list of token ids or a list of such lists, " <>
            "got: #{inspect(other)}"
  end
end
