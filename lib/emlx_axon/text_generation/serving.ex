if Code.ensure_loaded?(Nx.Serving) do
  defmodule EMLXAxon.TextGeneration.Serving do
    @moduledoc false
    # The Nx.Serving behind EMLXAxon.TextGeneration.serving/3, compiled only
    # where Nx is available. It is a thin adapter: what travels between the
    # callers and the executions, and how, is decided by plain modules that
    # need no Nx (Serving.Batch, Serving.Constraints, Serving.Execution,
    # Serving.Results, Serving.Events, and Serving.Scheduled for a serving
    # over EMLXAxon.Scheduler); this module only moves their binaries in and
    # out of tensors and implements the Nx.Serving callbacks.

    @behaviour Nx.Serving

    alias EMLXAxon.TextGeneration.{Input, Output}

    alias EMLXAxon.TextGeneration.Serving.{
      Batch,
      Constraints,
      Events,
      Execution,
      Results,
      Scheduled
    }

    @hook :chunk

    @doc false
    def new(tokenizer, state, opts) do
      # Generation runs outside Nx.Defn: the Evaluator only materializes
      # batches, and its :max_concurrency sets the number of partitions.
      defn_options = Keyword.put(opts.defn_options, :compiler, Nx.Defn.Evaluator)
      # The serving's own constraint fails here rather than in an execution.
      Constraints.check!(tokenizer, [%{constraint: opts.constraint}])

      serving =
        if opts.scheduler do
          scheduled(tokenizer, state, opts, defn_options)
        else
          direct(tokenizer, state, opts, defn_options)
        end

      case opts.compile[:batch_size] do
        nil -> serving
        batch_size -> Nx.Serving.batch_size(serving, batch_size)
      end
    end

    # Each execution generates its batch.
    defp direct(tokenizer, state, opts, defn_options) do
      opts = %{opts | mlx_stream: opts.mlx_stream || EMLXAxon.Stream.current()}
      arg = %{tokenizer: tokenizer, state: state, opts: opts}

      serving =
        __MODULE__
        |> Nx.Serving.new(arg, defn_options)
        |> Nx.Serving.process_options(batch_keys: Batch.batch_keys(opts))
        |> Nx.Serving.client_preprocessing(&preprocess(&1, tokenizer, state, opts))

      if opts.stream do
        serving
        |> Nx.Serving.streaming(hooks: [@hook])
        |> Nx.Serving.client_postprocessing(&postprocess_stream(&1, &2, tokenizer, opts))
      else
        Nx.Serving.client_postprocessing(serving, &postprocess(&1, &2, tokenizer, opts))
      end
    end

    # Each execution hands its rows to its partition's scheduler and returns
    # at once; callers wait for their tokens in the client postprocessing
    # (see Serving.Scheduled for why the caller submits). The batch carries
    # only the rows' count; each caller keeps its own requests. A streaming
    # serving streams the execution's result (no hooks): the process reading
    # it is the one that receives the tokens.
    defp scheduled(tokenizer, state, opts, defn_options) do
      arg = %{tokenizer: tokenizer, state: state, opts: opts}

      serving =
        __MODULE__
        |> Nx.Serving.new(arg, defn_options)
        |> Nx.Serving.client_preprocessing(&preprocess_scheduled(&1, tokenizer, state, opts))

      if opts.stream do
        serving
        |> Nx.Serving.streaming()
        |> Nx.Serving.client_postprocessing(&postprocess_scheduled_stream(&1, &2, arg))
      else
        Nx.Serving.client_postprocessing(serving, &postprocess_scheduled(&1, &2, arg))
      end
    end

    ## Nx.Serving callbacks

    @impl true
    def init(:process, %{opts: %{scheduler: true}} = arg, partitions) do
      case Scheduled.start_owned(arg.state, arg.tokenizer, arg.opts, length(partitions)) do
        {:ok, supervisor} -> {:ok, Map.put(arg, :owned, supervisor)}
        {:error, reason} -> raise "could not start the serving's schedulers: #{inspect(reason)}"
      end
    end

    def init(:inline, %{opts: %{scheduler: true}} = arg, _partitions) do
      {:ok, Map.put(arg, :owned, :inline)}
    end

    def init(_type, %{opts: %{scheduler: scheduler}} = arg, _partitions)
        when scheduler != false do
      {:ok, Map.put(arg, :owned, nil)}
    end

    def init(type, arg, partitions) do
      %{opts: %{mlx_stream: given}} = arg
      count = length(partitions)

      streams =
        partitions
        |> Enum.with_index()
        |> Map.new(fn {_defn_options, index} ->
          # One stream per partition, so partitions decode concurrently.
          if count > 1 or (type == :process and given == nil) do
            {index, EMLXAxon.Stream.new(if given, do: given.device, else: :default)}
          else
            {index, given}
          end
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
    def handle_batch(batch, partition, %{opts: %{scheduler: scheduler}} = state)
        when scheduler != false do
      rows = batch.size + batch.pad
      route = Scheduled.route(scheduler, state.owned, partition)
      {row, size} = Scheduled.encode_route(route)

      fun = fn ->
        {%{
           "route" => tensor({{:u, 8}, {rows, byte_size(row)}, :binary.copy(row, rows)}),
           "route_size" =>
             tensor({{:s, 32}, {rows}, :binary.copy(<<size::signed-native-32>>, rows)})
         }, %{}}
      end

      {:execute, fun, state}
    end

    def handle_batch(batch, partition, state) do
      stream = Map.fetch!(state.streams, partition)
      hook = Map.fetch!(state.hooks, partition)

      fun = fn ->
        tensors = Nx.Defn.jit_apply(&Function.identity/1, [batch], compiler: Nx.Defn.Evaluator)
        {_rows, width} = Nx.shape(tensors["input_ids"])

        binaries =
          Map.new(tensors, fn {name, tensor} -> {String.to_atom(name), Nx.to_binary(tensor)} end)

        {callers, binaries} = Map.pop(binaries, :caller)
        requests = Batch.decode(binaries, width, batch.size)
        callers = Batch.decode_callers(callers, batch.size)
        on_chunk = if hook, do: &hook.(chunk_container(&1))
        fields = Execution.run(state, requests, stream, on_chunk, callers)
        {Map.new(fields, fn {name, field} -> {name, tensor(field)} end), %{}}
      end

      {:execute, fun, state}
    end

    ## Client side

    defp requests!(input, tokenizer, state, opts) do
      {requests, multi?} = Input.requests!(tokenizer, state, input, opts)

      if opts.stream and multi? do
        raise ArgumentError,
              "a streaming serving takes one input at a time, " <>
                "call it with each input of the list separately"
      end

      {requests, multi?}
    end

    defp preprocess(input, tokenizer, state, opts) do
      {requests, multi?} = requests!(input, tokenizer, state, opts)

      Constraints.check!(tokenizer, requests)
      width = Batch.width!(requests, opts)
      n = length(requests)

      # The process waiting for the rows travels with them: an execution
      # whose callers have all exited stops (see Serving.Execution).
      {callers, shape} = Batch.encode_callers(self(), n)

      inputs =
        requests
        |> Batch.encode(width)
        |> Map.new(&field(&1, n))
        |> Map.put("caller", tensor({{:u, 8}, shape, callers}))

      batch = [inputs] |> Nx.Batch.concatenate() |> Nx.Batch.key(Batch.key(requests, width))
      {batch, multi?}
    end

    defp preprocess_scheduled(input, tokenizer, state, opts) do
      {requests, multi?} = requests!(input, tokenizer, state, opts)

      # The scheduler checks each input's constraint when the caller submits it.
      n = length(requests)
      rows = tensor({{:s, 32}, {n}, :binary.copy(<<0::signed-native-32>>, n)})
      {Nx.Batch.concatenate([%{"row" => rows}]), {requests, multi?}}
    end

    # A caller's rows may be split over executions of different partitions:
    # they all go to the scheduler of the partition that ran the first.
    defp postprocess_scheduled({output, _metadata}, {requests, multi?}, arg) do
      arg = Map.put(arg, :rows, length(requests))

      outputs =
        output
        |> first_route()
        |> Scheduled.with_scheduler(arg, &Scheduled.run!(&1, arg.state, requests, arg.opts))

      if multi?, do: outputs, else: hd(outputs)
    end

    defp postprocess_scheduled_stream(events, {[request], _multi?}, arg) do
      arg = Map.put(arg, :rows, 1)

      Elixir.Stream.flat_map(events, fn {:batch, output, _metadata} ->
        route = first_route(output)
        with_scheduler = &Scheduled.with_scheduler(route, arg, &1)
        Scheduled.stream_with(with_scheduler, arg.state, request, arg.opts)
      end)
    end

    defp first_route(%{"route" => routes, "route_size" => sizes}) do
      row = routes |> Nx.slice_along_axis(0, 1) |> Nx.to_binary()
      size = sizes |> Nx.slice_along_axis(0, 1) |> Nx.to_flat_list() |> hd()
      Scheduled.decode_route(row, size)
    end

    defp postprocess({output, _metadata}, multi?, tokenizer, opts) do
      outputs = outputs(output, tokenizer, opts)
      if multi?, do: outputs, else: hd(outputs)
    end

    defp postprocess_stream(events, _multi?, tokenizer, opts) do
      Elixir.Stream.flat_map(events, fn
        {@hook, %{text: text, text_size: size}} ->
          Events.items({:chunk, Nx.to_binary(text), Nx.to_number(size[0])}, opts.stream_done)

        {:batch, output, _metadata} ->
          [output] = outputs(output, tokenizer, opts)
          Events.items({:done, output}, opts.stream_done)
      end)
    end

    defp outputs(output, tokenizer, opts) do
      output
      |> Map.new(fn {name, tensor} -> {name, Nx.to_binary(tensor)} end)
      |> Results.decode(opts.max_new_tokens)
      |> Enum.map(fn row ->
        text = Output.text!(tokenizer, row.ids, row.finish_reason, opts.stop)

        row
        |> Map.put(:text, text)
        |> Output.build(row.metadata)
        |> Output.put_tool_calls(opts.tools)
      end)
    end

    ## Tensors

    # Batch.encode/2's fields: their types, and which hold a row per request
    # (the others hold one value per request).
    @field_types %{
      input_ids: {:s, 32},
      length: {:s, 32},
      seed: {:s, 64},
      constraint: {:u, 8},
      constraint_size: {:s, 32},
      constraint_kind: {:u, 8}
    }
    @row_fields [:input_ids, :constraint]

    defp field({name, binary}, n) do
      {_, bits} = type = Map.fetch!(@field_types, name)

      shape = if name in @row_fields, do: {n, div(byte_size(binary) * 8, n * bits)}, else: {n}

      {Atom.to_string(name), tensor({type, shape, binary})}
    end

    defp chunk_container(rows) do
      {matrix, shape, sizes} = Events.encode_chunk(rows)

      %{
        text: tensor({{:u, 8}, shape, matrix}),
        text_size: tensor({{:s, 32}, {elem(shape, 0)}, sizes})
      }
    end

    defp tensor({type, shape, binary}) do
      binary |> Nx.from_binary(type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
    end
  end
end
