if Code.ensure_loaded?(Nx.Serving) do
  defmodule EMLXAxon.TextGeneration.Serving do
    @moduledoc false
    # The Nx.Serving behind EMLXAxon.TextGeneration.serving/3, compiled only
    # where Nx is available.
    #
    # Inputs are tokenized in the client preprocessing and travel to the
    # serving as a batch of fixed-width tensors (prompts padded to :max_len),
    # so that Nx.Serving can merge the batches of several callers. Each
    # execution decodes its whole batch with ONE native generation. Results
    # travel back as fixed-width tensors (ids padded to :max_new_tokens), so
    # they can be sliced per caller and concatenated when a caller's input
    # was split over several executions; the client postprocessing turns
    # them into plain maps (decoding the text with the tokenizer).
    #
    # Streaming uses Nx.Serving's hooks: after every native chunk the
    # execution calls the :chunk hook with each row's new text as a u8
    # tensor, which Nx.Serving slices and sends to the callers.

    @behaviour Nx.Serving

    alias EMLXAxon.{Generation, TextGeneration}

    @hook :chunk
    @pad -1
    @finish_codes %{eos: 0, stop: 1, length: 2, max_len: 3, timeout: 4}
    @finish_reasons Map.new(@finish_codes, fn {reason, code} -> {code, reason} end)

    @doc false
    def new(tokenizer, state, opts) do
      # Generation runs outside Nx.Defn: the Evaluator only materializes
      # batches, and its :max_concurrency sets the number of partitions.
      defn_options = Keyword.put(opts.defn_options, :compiler, Nx.Defn.Evaluator)
      opts = %{opts | mlx_stream: opts.mlx_stream || EMLXAxon.Stream.current()}
      arg = %{tokenizer: tokenizer, state: state, opts: opts}

      serving =
        __MODULE__
        |> Nx.Serving.new(arg, defn_options)
        |> Nx.Serving.client_preprocessing(&preprocess(&1, tokenizer, state, opts))

      if opts.stream do
        serving
        |> Nx.Serving.streaming(hooks: [@hook])
        |> Nx.Serving.client_postprocessing(&postprocess_stream(&1, &2, tokenizer, opts))
      else
        Nx.Serving.client_postprocessing(serving, &postprocess(&1, &2, tokenizer, opts))
      end
    end

    ## Nx.Serving callbacks

    @impl true
    def init(type, arg, partitions) do
      %{opts: %{mlx_stream: given}} = arg
      count = length(partitions)

      streams =
        partitions
        |> Enum.with_index()
        |> Map.new(fn {_defn_options, index} ->
          stream =
            cond do
              # One stream per partition, so partitions decode concurrently.
              count > 1 or (type == :process and given == nil) ->
                device = if given, do: given.device, else: :default
                EMLXAxon.Stream.new!(device)

              true ->
                given
            end

          {index, stream}
        end)

      hooks =
        partitions
        |> Enum.with_index()
        |> Map.new(fn {defn_options, index} ->
          {index, get_in(defn_options, [:hooks, @hook])}
        end)

      {:ok, Map.merge(arg, %{streams: streams, hooks: hooks})}
    end

    @impl true
    def handle_batch(batch, partition, state) do
      stream = Map.get(state.streams, partition)
      hook = Map.get(state.hooks, partition)

      fun = fn ->
        %{"input_ids" => input_ids, "length" => lengths} =
          Nx.Defn.jit_apply(&Function.identity/1, [batch], compiler: Nx.Defn.Evaluator)

        size = batch.size

        prompts =
          input_ids
          |> Nx.to_list()
          |> Enum.zip(Nx.to_flat_list(lengths))
          |> Enum.take(size)
          |> Enum.map(fn {row, length} -> Enum.take(row, length) end)

        execute(state, prompts, stream, hook)
      end

      {:execute, fun, state}
    end

    defp execute(state, prompts, stream, hook) do
      %{tokenizer: tokenizer, state: model, opts: opts} = state
      on_chunk = if hook, do: &hook.(chunk_container(&1))
      stream_ref = EMLXAxon.Stream.resolve(stream)

      case Generation.run(model, tokenizer, stream_ref, prompts, opts, on_chunk) do
        {:ok, %{rows: rows, stats: stats}} ->
          {output_container(rows, stats, opts.max_new_tokens), batch_metadata(stats)}

        {:error, error} ->
          raise error
      end
    end

    ## Client side

    defp preprocess(input, tokenizer, state, opts) do
      {prompts, multi?} = TextGeneration.prompts!(tokenizer, state, input, opts)

      if opts.stream and multi? do
        raise ArgumentError,
              "a streaming serving takes one input at a time, " <>
                "call it with each input of the list separately"
      end

      width = opts.max_len

      Enum.each(prompts, fn prompt ->
        if length(prompt) >= width do
          raise EMLXAxon.Error,
            kind: :prompt_too_long,
            message:
              "prompt has #{length(prompt)} tokens but max_len is #{width}: " <>
                "it must leave room for at least one generated token"
        end
      end)

      input_ids =
        prompts
        |> Enum.map(&(&1 ++ List.duplicate(0, width - length(&1))))
        |> Nx.tensor(type: :s32, backend: Nx.BinaryBackend)

      lengths = Nx.tensor(Enum.map(prompts, &length/1), type: :s32, backend: Nx.BinaryBackend)
      batch = Nx.Batch.concatenate([%{"input_ids" => input_ids, "length" => lengths}])
      {batch, multi?}
    end

    defp postprocess({output, metadata}, multi?, tokenizer, opts) do
      outputs = outputs(output, metadata, tokenizer, opts)
      if multi?, do: outputs, else: hd(outputs)
    end

    defp postprocess_stream(events, _multi?, tokenizer, opts) do
      Elixir.Stream.transform(events, nil, fn
        {@hook, %{text: text, text_size: text_size}}, acc ->
          [size] = Nx.to_flat_list(text_size)

          case binary_part(Nx.to_binary(text), 0, size) do
            "" -> {[], acc}
            chunk -> {[chunk], acc}
          end

        {:batch, output, metadata}, acc ->
          if opts.stream_done do
            [output] = outputs(output, metadata, tokenizer, opts)
            {[{:done, output}], acc}
          else
            {[], acc}
          end
      end)
    end

    defp outputs(output, metadata, tokenizer, opts) do
      %{
        token_ids: token_ids,
        num_tokens: num_tokens,
        prompt_tokens: prompt_tokens,
        finish_reason: finish_reason
      } = output

      [
        Nx.to_list(token_ids),
        Nx.to_flat_list(num_tokens),
        Nx.to_flat_list(prompt_tokens),
        Nx.to_flat_list(finish_reason)
      ]
      |> Enum.zip_with(fn [ids, count, prompt_count, code] ->
        ids = Enum.take(ids, count)
        reason = Map.fetch!(@finish_reasons, code)

        row_metadata =
          Map.merge(metadata, %{prompt_tokens: prompt_count, generated_tokens: count})

        TextGeneration.output_from_ids(tokenizer, ids, reason, opts.stop, row_metadata)
      end)
    end

    ## Tensors

    defp chunk_container(rows) do
      texts = Enum.map(rows, & &1.text)
      width = texts |> Enum.map(&byte_size/1) |> Enum.max(fn -> 0 end) |> max(1)

      binary =
        IO.iodata_to_binary(
          Enum.map(texts, fn text -> [text, :binary.copy(<<0>>, width - byte_size(text))] end)
        )

      %{
        text:
          binary
          |> Nx.from_binary(:u8, backend: Nx.BinaryBackend)
          |> Nx.reshape({length(rows), width}),
        text_size: Nx.tensor(Enum.map(texts, &byte_size/1), type: :s32, backend: Nx.BinaryBackend)
      }
    end

    defp output_container(rows, stats, max_new_tokens) do
      ids =
        Enum.map(rows, fn %{ids: ids} ->
          ids ++ List.duplicate(@pad, max_new_tokens - length(ids))
        end)

      %{
        token_ids: Nx.tensor(ids, type: :s32, backend: Nx.BinaryBackend),
        num_tokens: tensor(Enum.map(rows, &length(&1.ids)), :s32),
        prompt_tokens: tensor(stats.prompt_tokens, :s32),
        finish_reason: tensor(Enum.map(rows, &Map.fetch!(@finish_codes, &1.finish_reason)), :u8)
      }
    end

    defp tensor(list, type), do: Nx.tensor(list, type: type, backend: Nx.BinaryBackend)

    defp batch_metadata(stats) do
      stats
      |> Map.drop([:prompt_tokens, :generated_tokens])
      |> Map.put(:batch_size, length(stats.prompt_tokens))
    end
  end
end
